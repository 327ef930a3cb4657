"""Check a report.json (as data) against the JSON Schema the package ships."""

from __future__ import annotations

import copy
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
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in report_validator().iter_errors(report)]


def assert_valid_report(report) -> None:
    errors = schema_errors(report)
    assert not errors, "report.json does not match alpa_job/record/report.schema.json:\n" + "\n".join(errors[:20])


def record_with_input(processes: int = 2, resumed_from_step=None):
    """A run record as token-data training writes it, built in memory (no Ray, no jax): `processes`
    processes each reading its own share, an input record (process 0's numbers) and three eval points."""
    from alpa_job.record.run_record import EvalPoint, InputRecord, MeshShape, ProcessInfo, ProcessResult, RunRecord

    start = resumed_from_step or 0
    rows_each = 960 // processes
    results = []
    for pid in range(processes):
        info = ProcessInfo(
            id=pid,
            count=processes,
            host=f"node{pid}",
            ip=f"10.0.0.{pid + 1}",
            local_devices=["gpu:0", "gpu:1"],
            rows_read=rows_each,
            bytes_read=rows_each * 516,
        )
        results.append(
            ProcessResult(
                engine="jax",
                strategy="data",
                mesh=MeshShape([2 * processes, 1], ["data", "model"]),
                process=info,
                steps=30 - start,
                losses=[7.0 - 0.1 * i for i in range(30 - start)],
                eval_loss=4.07,
                evals=[EvalPoint(10, 6.39, 596.19, 2), EvalPoint(20, 5.3, 200.34, 2), EvalPoint(30, 4.07, 58.56, 2)],
                input=InputRecord(
                    dataset="tokens: 1 file(s), 3,124 windows of 129",
                    rows=3124,
                    steps_per_epoch=97,
                    epochs=0.3093,
                    rows_read=rows_each,
                    bytes_read=rows_each * 516,
                    bytes_per_s=30582.5,
                    data_wait_s=0.0086,
                    data_wait_per_step_s=0.000287,
                    data_wait_fraction=0.0005,
                    pipeline="grain",
                ),
                resumed_from_step=resumed_from_step,
            )
        )
    return RunRecord.from_processes(results, {"model": "gpt"}, created="2026-01-01T00:00:00Z")


def without_input(report: dict) -> dict:
    """report.json as the kit wrote it before the input pipeline: no input, evals or per-process reads."""
    old = {k: copy.deepcopy(v) for k, v in report.items() if k not in ("input", "evals")}
    for key in ("process", "processes"):
        rows = [old[key]] if key == "process" else old[key]
        for row in rows:
            row.pop("rows_read", None)
            row.pop("bytes_read", None)
    return old


def read_events(folder):
    """{tag: [(step, value)]} and {text tag: text} of a TensorBoard run folder, through TensorBoard's reader."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(folder), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    texts = {tag.split("/")[0]: acc.Tensors(tag)[-1].tensor_proto.string_val[0].decode() for tag in acc.Tags()["tensors"]}
    return scalars, texts


def close_to(logged, expected):
    return abs(logged - expected) <= 1e-5 * max(1.0, abs(expected))  # event files hold float32
