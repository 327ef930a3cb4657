"""Honest timing for the report: phases, and the steady-state step time as a distribution.

The loop never syncs with the device per step (that would stall the pipeline); it syncs once per
window of steps (`window_size`), on the step before the newest (so the device always has a step
queued), and records the window's time per step. The first step is timed
on its own: it carries whatever the runtime does lazily on first use, so averaging it in (what
`step_time_s` = loop seconds / steps does) overstates the step on short runs (by about a quarter for a
large model). Plain Python (Python 3.9).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from alpa_job.engines.flops import maxtext_flops, peak  # MFU is reported for the devices and precisions it knows
from alpa_job.record.startup import startup_breakdown


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Python's own start and imports included); None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def window_size(steps: int) -> int:
    """Steps per timing window: about 20 windows a run, at least 1 step, at most 10."""
    return max(1, min(10, steps // 20))


def percentile(values: List[float], q: float) -> float:
    return percentile_sorted(sorted(values), q)


def percentile_sorted(ordered: List[float], q: float) -> float:
    """`percentile` of values already in order (the loop keeps its windows sorted as they come)."""
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def steady_state(window_step_s: List[float], samples_per_step: Optional[float] = None) -> Optional[Dict[str, float]]:
    """Median, p10 and p90 of the per-step times of the windows after the first step, and the steady rate
    (`samples_per_s`: samples per step over the median step time, what the progress line shows)."""
    if not window_step_s:
        return None
    median = percentile(window_step_s, 0.5)
    out = {
        "median_s": round(median, 6),
        "p10_s": round(percentile(window_step_s, 0.1), 6),
        "p90_s": round(percentile(window_step_s, 0.9), 6),
        "windows": len(window_step_s),
    }
    rate = steady_rate(samples_per_step, median)
    if rate is not None:
        out["samples_per_s"] = round(rate, 2)
    return out


def steady_rate(samples_per_step: Optional[float], median_step_s: Optional[float]) -> Optional[float]:
    """Samples per second at the steady-state step time: the one rate the report and the progress line give.
    (Samples over the loop's wall time counts the first step, evals and checkpoint saves as training.)"""
    if not samples_per_step or not median_step_s or median_step_s <= 0:
        return None
    return samples_per_step / median_step_s


def summary(
    phases: Dict[str, Optional[float]],
    window_step_s: List[float],
    flops_per_step: Optional[float],
    device_kind: Optional[str],
    dtype: str,
    device_count: int,
    peak_memory_bytes: Optional[int],
    peak_estimate_bytes: Optional[int],
    samples_per_step: Optional[float] = None,
    tokens_per_sample: Optional[int] = None,
    causal_attention_flops: Optional[float] = None,
) -> Dict[str, Any]:
    """The report's `timing`: phases (seconds), steady state, TFLOP/s and MFU, memory measured vs estimated.

    `flops_per_step`: the step's model FLOPs over all `device_count` devices, every product whole
    (engines/flops.py); `causal_attention_flops`: the part causal attention's products make. The MFU counts
    as MaxText does (`mfu_flops_per_step`: causal attention at half; `mfu_count` says "maxtext", or "full"
    where no causal attention was counted) and on two bases, where the device and the precision are in
    flops.PEAKS: `mfu` against the measured matmul rate, `mfu_datasheet` against the vendor's; `peak` names
    both and the precision. `tflops_per_device` is on the same count; `..._full` are all three on the full
    count. Tokens/s per device for a model with a sequence length."""
    steady = steady_state(window_step_s, samples_per_step)
    rates = peak(device_kind, dtype)
    mfu_flops = maxtext_flops(flops_per_step, causal_attention_flops)
    out: Dict[str, Any] = {
        "phases_s": {k: (round(v, 3) if v is not None else None) for k, v in phases.items()},
        "startup_breakdown": startup_breakdown(phases),
        "steady_step": steady,
        "flops_per_step": flops_per_step,
        "causal_attention_flops_per_step": causal_attention_flops,
        "mfu_flops_per_step": mfu_flops,
        "mfu_count": "maxtext" if causal_attention_flops else "full",
        "tflops_per_device": None,
        "mfu": None,
        "mfu_datasheet": None,
        "tflops_per_device_full": None,
        "mfu_full": None,
        "mfu_datasheet_full": None,
        "peak": {
            "precision": rates["precision"],
            "measured_tflops": _tera(rates["measured"]),
            "datasheet_tflops": _tera(rates["datasheet"]),
        },
        "peak_memory_bytes": peak_memory_bytes,
        "peak_estimate_bytes": peak_estimate_bytes,
        "devices": device_count,
    }
    if steady:
        for suffix, count in (("", mfu_flops), ("_full", flops_per_step)):
            out.update(_rates(count, device_count, steady["median_s"], device_kind, dtype, suffix))
        if tokens_per_sample and steady.get("samples_per_s"):
            out["tokens_per_s_per_device"] = round(steady["samples_per_s"] * tokens_per_sample / max(device_count, 1), 1)
    return out


def _rates(
    flops_per_step: Optional[float], device_count: int, step_s: float, device_kind: Optional[str], dtype: str, suffix: str
) -> Dict[str, Optional[float]]:
    """{tflops_per_device, mfu, mfu_datasheet}+suffix of `flops_per_step` at `step_s`, rounded for the report."""
    tflops, mfu, mfu_datasheet = device_rate(flops_per_step, device_count, step_s, device_kind, dtype)
    return {
        f"tflops_per_device{suffix}": round(tflops, 1) if tflops is not None else None,
        f"mfu{suffix}": round(mfu, 3) if mfu is not None else None,
        f"mfu_datasheet{suffix}": round(mfu_datasheet, 3) if mfu_datasheet is not None else None,
    }


def _tera(flops: Optional[float]) -> Optional[float]:
    return round(flops / 1e12, 1) if flops else None


def device_rate(
    flops_per_step: Optional[float], device_count: int, step_s: float, device_kind: Optional[str], dtype: str
) -> Tuple[Optional[float], Optional[float], Optional[float]]:
    """(TFLOP/s per device, MFU on the measured peak, MFU on the datasheet's) of a step taking `step_s`; None
    where unknown (an MFU: a device and precision not in flops.PEAKS)."""
    if not flops_per_step or not step_s or step_s <= 0:
        return None, None, None
    rate = flops_per_step / max(device_count, 1) / step_s
    rates = peak(device_kind, dtype)
    return (rate / 1e12, rate / rates["measured"] if rates["measured"] else None, rate / rates["datasheet"] if rates["datasheet"] else None)
