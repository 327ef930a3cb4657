"""One wording for "that name is not one of ours": the choices, and the nearest one when it is a typo.

Used for --model, presets, enum settings and unknown keys in config files, so every such error reads
the same and always names the fix.
"""

from __future__ import annotations

import difflib
from typing import Iterable


def did_you_mean(value: object, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for a near miss (difflib's ratio >= 0.6), else ''."""
    close = difflib.get_close_matches(str(value), list(choices), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def not_known(what: str, value: object, choices: Iterable[str]) -> str:
    """'WHAT 'VALUE' is not known; use one of: a, b, c (did you mean b?)' -- one line."""
    choices = list(choices)
    return f"{what} {value!r} is not known; use one of: {', '.join(choices)}{did_you_mean(value, choices)}"
