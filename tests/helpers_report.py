"""Check a report.json (as data) against the JSON Schema the package ships."""
from __future__ import annotations

import functools

import jsonschema

from alpa_job.record.run_record import load_schema


@functools.lru_cache(maxsize=1)
def report_validator() -> jsonschema.Draft202012Validator:
    schema = load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def schema_errors(report) -> list:
    """Every schema violation, as 'path: message' lines (empty: the report is valid)."""
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in report_validator().iter_errors(report)]


def assert_valid_report(report) -> None:
    errors = schema_errors(report)
    assert not errors, "report.json does not match alpa_job/record/report.schema.json:\n" + "\n".join(errors[:20])
