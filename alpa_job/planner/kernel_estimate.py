"""Step time from the kernels of a step compiled for the GPU (kernel_cost.py) and a GPU profile's rates.

Each kernel takes the longer of its compute and its memory traffic, plus the cost of starting it:

    matmul, convolution, attention:  max(FLOPs / rate + start, bytes / HBM + launch)
    every other kernel:              launch + bytes / HBM

`rate` and `start` are fitted to the profile's matmul grid for the kernel's precision (t = FLOPs / rate +
start over the measured shapes, so small products pay what small products measured), HBM and launch are the
profile's. A collective takes latency + bytes on NVLink / the profile's bus bandwidth for its kind + bytes on
the network / the network's bandwidth; an async one is hidden by the kernels that run between its start and
its done, and only what they do not cover is added. The step is the kernels in order, the collectives' exposed
time, and the host's time a step (`host`): the profile's floor of the kit's training loop on as many devices
as a process drives (its loop over a near-empty model: bookkeeping, the batch's transfer, the dispatch), or,
in a profile without one, the dispatch of one jitted call. The floor is added, not hidden behind the
kernels: the profiled calibration run's step is its kernels' sum plus about that floor.

Three constants are fitted to profiled runs of the calibration model (calibration.json's `kernel_ms`: the
kernel time of each kind that the GPU's profiler measured): how much faster a compiled step's matmuls run
than the profile's grid (`matmul_factor`), fused attention's rate as a share of the bf16 matmul rate
(`attention_share`), and the share of the profile's HBM bandwidth that fusions reach (`hbm_factor`). A
collective's bandwidth and start come from the profile's chains of collectives of a few sizes.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Dict, List, Optional, Tuple

PRODUCTS = ("matmul", "convolution", "attention")
NCCL_LATENCY_S = 20e-6  # a small collective between GPUs of one node, where no profile measured one
TERMS = ("compute", "memory", "launches", "NVLink", "network", "host")


@dataclasses.dataclass
class Rates:
    matmul: Dict[str, Tuple[float, float]]  # precision -> (FLOP/s, seconds to start one product)
    hbm_bytes_s: float
    launch_s: float
    dispatch_s: float
    links: Dict[str, Tuple[float, float]]  # collective kind -> (NVLink bus bytes/s, seconds to start one)
    source: str
    loop_floors: Dict[int, float] = dataclasses.field(default_factory=dict)  # devices -> the loop's step seconds

    def product(self, precision: str) -> Tuple[float, float]:
        return self.matmul.get(precision) or self.matmul["bf16"]

    def loop_floor(self, local_devices: int) -> float:
        """The loop's floor measured on the most devices not above `local_devices` (else the fewest); 0 where
        the profile measured none."""
        if not self.loop_floors:
            return 0.0
        below = [n for n in self.loop_floors if n <= local_devices]
        return self.loop_floors[max(below) if below else min(self.loop_floors)]


@dataclasses.dataclass
class KernelConstants:
    matmul_factor: float = 1.0
    attention_share: float = 0.4
    hbm_factor: float = 1.0
    fitted_from: Tuple[str, ...] = ()

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def fit_grid(points: List[Tuple[float, float]]) -> Tuple[float, float]:
    """(rate, start) of t = work / rate + start, least squares on the relative error; one point: its rate."""
    if len(points) == 1:
        flops, seconds = points[0]
        return flops / seconds, 0.0
    # minimise sum((a f + b) / t - 1)^2 over (a, b): the 2 x 2 normal equations
    s_ff = sum((f / t) ** 2 for f, t in points)
    s_f1 = sum(f / t / t for f, t in points)
    s_11 = sum(1 / t / t for _, t in points)
    s_f = sum(f / t for f, t in points)
    s_1 = sum(1 / t for _, t in points)
    det = s_ff * s_11 - s_f1 * s_f1
    a = (s_f * s_11 - s_1 * s_f1) / det
    b = (s_ff * s_1 - s_f1 * s_f) / det
    if b < 0:  # a start cannot be negative: the rate alone
        a, b = sum(f * t for f, t in points) / sum(f * f for f, _ in points), 0.0
    return 1 / a, b


def rates_from_profile(profile: Dict[str, Any], hbm_bytes_s: Optional[float] = None, where: str = "") -> Rates:
    """The rates a GPU profile measured (plan calibrate); `hbm_bytes_s` replaces its HBM (another GPU of the
    same compute)."""
    grid: Dict[str, List[Tuple[float, float]]] = {}
    for m in profile["matmul"]:
        flops = 2.0 * m["m"] * m["n"] * m["k"]
        grid.setdefault(m["precision"], []).append((flops, flops / m["flops_s"]))
    matmul = {precision: fit_grid(points) for precision, points in grid.items()}
    if "bf16" not in matmul:
        matmul["bf16"] = (profile["peak_flops"]["bf16"], 0.0)
    sizes: Dict[str, List[Tuple[float, float]]] = {}
    for c in profile["collectives"]:
        if c.get("devices", 1) > 1 and c.get("chain"):  # timed inside one program (older profiles: per call)
            sizes.setdefault(c["op"], []).append((c["busbw_bytes_s"] * c["seconds"], c["seconds"]))
    return Rates(
        matmul=matmul,
        hbm_bytes_s=hbm_bytes_s or profile["hbm"]["bytes_s"],
        launch_s=profile["launch"]["kernel_seconds"],
        dispatch_s=profile["launch"]["dispatch_seconds"],
        links={op: fit_grid(points) for op, points in sizes.items()},
        source=where,
        loop_floors={row["devices"]: row["step_seconds"] for row in profile.get("loop", [])},
    )


def link(rates: Rates, kind: str, nvlink_bytes_s: float) -> Tuple[float, float]:
    """(bus bytes/s, start seconds) of a collective kind on NVLink: the profile's for it, else its nearest
    measured kind (a reduce-scatter or a permute moves data as an all-gather does), else the catalogue's
    bandwidth with NCCL's small-message latency."""
    like = "all-reduce" if kind == "all-reduce" else "all-gather"
    found = rates.links.get(kind) or rates.links.get(like) or next(iter(rates.links.values()), None)
    return found or (nvlink_bytes_s, NCCL_LATENCY_S)


def kernel_seconds(row: List[Any], rates: Rates, constants: KernelConstants) -> Dict[str, float]:
    """One kernel's time split into the terms that make it: {compute, memory, launches}."""
    kind, precision, flops, moved = row[0], row[1], row[2], row[3]
    memory = moved / (rates.hbm_bytes_s * constants.hbm_factor)
    if kind in PRODUCTS and flops > 0:
        rate, start = rates.product("bf16" if kind == "attention" else precision)
        rate *= constants.attention_share if kind == "attention" else constants.matmul_factor
        compute = flops / rate
        if compute + start >= memory + rates.launch_s:
            return {"compute": compute, "memory": 0.0, "launches": start}
    return {"compute": 0.0, "memory": memory, "launches": rates.launch_s}


def predict(
    features: Dict[str, Any],
    rates: Rates,
    constants: KernelConstants,
    network_bytes_s: float,
    nvlink_bytes_s: float,
    local_devices: int = 1,
) -> Dict[str, Any]:
    """step_s and its terms (seconds a step): compute, memory, launches (kernels), NVLink and network (the
    collectives' time that no kernel hides), host (the loop's floor on `local_devices` devices a process),
    and kernels_s, the kernels' sum."""
    per_row = [kernel_seconds(row, rates, constants) for row in features["kernels"]]
    terms = {t: 0.0 for t in TERMS}
    for row, split in zip(features["kernels"], per_row):
        for term, seconds in split.items():
            terms[term] += seconds * row[4]
    row_s = [sum(split.values()) for split in per_row]
    for c in features["collectives"]:
        bandwidth, start = link(rates, c["kind"], nvlink_bytes_s)
        nvlink = c["nvlink_bytes"] / bandwidth
        network = c["network_bytes"] / network_bytes_s
        if nvlink + network == 0:
            continue
        busy = start + nvlink + network
        hidden = sum(row_s[row] * count for row, count in c["beside"])
        exposed = max(busy - hidden, 0.0)
        terms["NVLink"] += exposed * (start + nvlink) / busy * c["runs"]
        terms["network"] += exposed * network / busy * c["runs"]
    kernels = terms["compute"] + terms["memory"] + terms["launches"]
    terms["host"] = rates.loop_floor(local_devices) or rates.dispatch_s
    step = kernels + terms["NVLink"] + terms["network"] + terms["host"]
    return {"step_s": step, "kernels_s": kernels, "terms": terms, "dominant": max(terms, key=terms.get)}


def kind_seconds(features: Dict[str, Any], rates: Rates, constants: KernelConstants) -> Dict[str, float]:
    """Predicted kernel time a step per measured kind: products (matmul and convolution), attention, memory
    (every other kernel)."""
    out = {"products": 0.0, "attention": 0.0, "memory": 0.0}
    for row in features["kernels"]:
        seconds = sum(kernel_seconds(row, rates, constants).values()) * row[4]
        out["attention" if row[0] == "attention" else "products" if row[0] in PRODUCTS else "memory"] += seconds
    return out


def fit(entries: List[Dict[str, Any]], rates: Rates, rounds: int = 8) -> KernelConstants:
    """The constants from runs whose kernel time per kind was measured (entry["kernel_ms"]) beside the
    features of the program they ran (entry["kernels"]): each kind's factor is moved by measured / predicted
    (the geometric mean over the runs) until they agree."""
    runs = [e for e in entries if e.get("kernel_ms") and e.get("kernels")]
    constants = KernelConstants(fitted_from=tuple(e["id"] for e in runs))
    fields = {"products": "matmul_factor", "attention": "attention_share", "memory": "hbm_factor"}
    for _ in range(rounds if runs else 0):
        for kind, name in fields.items():
            ratios = []
            for e in runs:
                measured, predicted = e["kernel_ms"].get(kind), kind_seconds(e["kernels"], rates, constants)[kind]
                if measured and predicted > 0:
                    ratios.append(predicted / (measured / 1e3))
            if ratios:
                moved = getattr(constants, name) * math.exp(statistics.mean(math.log(r) for r in ratios))
                setattr(constants, name, min(max(moved, 0.05), 5.0))
    return constants


def validation(rates: Rates, constants: KernelConstants, entries: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The error to expect: each measured run of `entries` (validation.json's) with a `kernels` block (runs the constants were not
    fitted on) predicted now; the median and worst of the errors, the models they cover, and for each model
    measured with several strategies on one device count, the predicted winner's measured step against the
    measured winner's (`winners`)."""
    rows = []
    for e in entries:
        if not e.get("kernels"):
            continue
        network = e.get("network_gbps", 400.0) * 1e9 / 8
        got = predict(e["kernels"], rates, constants, network, 450e9, e["gpus_per_node"])
        peak = (e.get("memory_gpu") or {}).get("peak_estimate_bytes")
        rows.append(
            {
                "id": e["id"],
                "model": e.get("model_name") or e.get("preset"),
                "gpus": e["nodes"] * e["gpus_per_node"],
                "strategy": e["strategy"],
                "predicted_ms": got["step_s"] * 1e3,
                "measured_ms": e["measured_step_ms"],
                "error": got["step_s"] * 1e3 / e["measured_step_ms"] - 1,
                "dominant": got["dominant"],
                "predicted_peak_gb": peak / 1e9 if peak else None,
                "measured_peak_gb": e.get("measured_peak_gb"),
            }
        )
    errors = sorted(abs(r["error"]) for r in rows)
    return {
        "runs": rows,
        "median": statistics.median(errors) if errors else None,
        "worst": errors[-1] if errors else None,
        "models": sorted({str(r["model"]) for r in rows}),
        "winners": _winners(rows),
    }


def _winners(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    groups: Dict[Tuple[str, int], List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((str(r["model"]), r["gpus"]), []).append(r)
    out = []
    for (model, gpus), runs in sorted(groups.items()):
        if len(runs) < 2:
            continue
        chosen = min(runs, key=lambda r: r["predicted_ms"])
        best = min(runs, key=lambda r: r["measured_ms"])
        out.append(
            {
                "model": model,
                "gpus": gpus,
                "predicted_winner": chosen["strategy"],
                "measured_winner": best["strategy"],
                "slower_by": chosen["measured_ms"] / best["measured_ms"] - 1,
            }
        )
    return out
