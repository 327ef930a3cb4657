"""JSON that every parser reads: a NaN or an infinity becomes null.

Python's json writes float('nan') as the bare token `NaN` (and `Infinity`), which is not JSON: a strict
reader (jq, JavaScript's JSON.parse, Go, a schema validator) rejects the whole file. A diverged run's
losses are exactly such numbers, so every file the kit writes goes through `dumps`/`dump`, which turn
them into null and let json refuse (allow_nan=False) anything that still slips through. Standard
library only (the Alpa image's Python 3.9 imports it too).
"""

from __future__ import annotations

import json
import math
from typing import Any, IO


def finite(value: Any) -> Any:
    """`value` with every non-finite float (nan, inf, -inf) inside dicts, lists and tuples as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """json.dumps of `value` with non-finite floats as null (strict JSON)."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def dump(value: Any, handle: IO[str], **kwargs: Any) -> None:
    """json.dump of `value` with non-finite floats as null (strict JSON)."""
    json.dump(finite(value), handle, allow_nan=False, **kwargs)
