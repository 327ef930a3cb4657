"""`python -m alpa_job plan calibrate`: measure this machine's accelerator and save a GPU profile for `plan`.

With jax on the local devices, bounded in time (`--budget-s`), one progress line a measurement:
- matmul: dense products of random matrices for a small grid of (M, N, K) shapes in each precision the
  device has (bf16; float32 at jax's default precision, TF32 on Ampere and later; float32 at HIGHEST; fp8
  e4m3 x e4m3 -> bf16 on compute capability >= 8.9). One jitted call holds R independent products (R so a
  call is long enough that the kernels run back to back), calls are queued and the clock read once they
  are done: the rate a compiled step's kernels of that shape can reach, not Python's dispatch;
- hbm: `y = 2x + 1` over an array several times any cache (read once, written once);
- launch: a chain of tiny adds kept apart by optimization barriers (one kernel each) minus a chain of one:
  the cost of one more kernel inside a compiled program; and `dispatch`, one trivial jitted call from Python;
- loop: the kit's own training loop (`python -m alpa_job train`) over a model that leaves the device next
  to nothing, on one device and on all: its steady step time is the host's share of every step (the loop's
  bookkeeping, the batch's transfer, the step's dispatch), the floor under any model's step;
- collectives (more than one local device): all-reduce and all-gather over all of them, a few sizes, each
  call a chain of several that depend on each other (so a call's dispatch to every device is paid once, as
  inside a compiled step), as bus bandwidth (nccl-tests' convention: all-reduce bytes x 2(n-1)/n / time, all-gather output bytes x
  (n-1)/n / time), the per-device link figure the planner's traffic model divides by.

Each measurement is the median of 3 timed batches. On a CPU it runs too, on small sizes, and the profile
says its numbers are the CPU's (the planner refuses it). The profile's schema is gpu_profile.py's.
"""

from __future__ import annotations

import collections
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from alpa_job.errors import KitError
from alpa_job.planner import gpu_profile

Shape = Tuple[int, int, int]

# The (M, N, K) grid. GPU: squares 1k..16k and a GPT-24L step's products (8192 tokens, d_model 2048: the
# attention projections, the MLP's two products, the vocabulary's).
GPU_GRID: Dict[str, List[Shape]] = {
    "bf16": [
        (8192, 8192, 8192),
        (4096, 4096, 4096),
        (2048, 2048, 2048),
        (1024, 1024, 1024),
        (16384, 16384, 16384),
        (8192, 2048, 2048),
        (8192, 8192, 2048),
        (8192, 2048, 8192),
        (8192, 32768, 2048),
    ],
    "tf32": [(8192, 8192, 8192), (4096, 4096, 4096), (2048, 2048, 2048)],
    "fp8": [(8192, 8192, 8192), (16384, 16384, 16384), (4096, 4096, 4096)],
    "fp32": [(4096, 4096, 4096)],
}
CPU_GRID: Dict[str, List[Shape]] = {"bf16": [(128, 128, 128)], "fp32": [(256, 256, 256), (512, 128, 256)]}
SIZES = {  # per measurement kind: GPU and CPU
    "hbm_bytes": (2**30, 16 * 2**20),  # the array read (and as much written)
    "collective_bytes": ((2**20, 16 * 2**20, 256 * 2**20), (2**20,)),
    "call_flops": (2e11, 2e6),  # a matmul call holds this much work at least (R products, R <= 32)
    "batch_s": (0.15, 0.01),  # seconds of queued calls a timed batch aims at
}
LAUNCH_CHAIN = 256
COLLECTIVE_CHAIN = 16  # collectives a timed call holds at most (fewer of the largest sizes)
BATCHES = 3
# The loop floor's model: a 2-block GPT of width 64 on 16 tokens, one sample a device; 60 steps make 20
# timing windows of 3 (the loop's windows for a run of that length).
LOOP_MODEL = ["--preset", "gpt-small", "--num-layers", "2", "--d-model", "64", "--num-heads", "2", "--seq-len", "16"]
LOOP_STEPS = 60
IN_FLIGHT = 8  # queued calls not yet waited for


class Clock:
    """Time left of the budget, and one progress line per measurement on stderr."""

    def __init__(self, budget_s: float, total: int, stream=None):
        self.start, self.budget_s, self.total, self.done = time.perf_counter(), budget_s, total, 0
        self.stream = stream or sys.stderr

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over(self) -> bool:
        return self.elapsed() > self.budget_s

    def line(self, text: str) -> None:
        self.done += 1
        print(f"[calibrate] {self.done}/{self.total} {text}  ({self.elapsed():.0f} s)", file=self.stream, flush=True)


def timed_batches(call: Callable[[], Any], batch_s: float, batches: int = BATCHES) -> float:
    """Seconds one call takes on the device: warmed up, then `batches` batches of queued calls, each
    timed from the first dispatch to the last result (calls on one device run in order); the median."""
    _block(call())  # compile and warm
    start = time.perf_counter()
    _block(call())
    once = max(time.perf_counter() - start, 1e-7)
    n = max(2, min(500, int(batch_s / once)))
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        queued: Deque[Any] = collections.deque()
        for _ in range(n):
            queued.append(call())
            if len(queued) > IN_FLIGHT:  # bounds the outputs alive at once, keeps the device fed
                _block(queued.popleft())
        for out in queued:
            _block(out)
        times.append((time.perf_counter() - start) / n)
    return statistics.median(times)


def _block(out) -> None:
    import jax

    jax.block_until_ready(out)


def _precision_setup(precision: str):
    """(operand dtype, lax precision, result dtype) of one precision's product."""
    import jax
    import jax.numpy as jnp

    return {
        "bf16": (jnp.bfloat16, None, None),
        "tf32": (jnp.float32, None, None),
        "fp32": (jnp.float32, jax.lax.Precision.HIGHEST, None),
        "fp8": (jnp.float8_e4m3fn, None, jnp.bfloat16),
    }[precision]


def matmul_rate(shape: Shape, precision: str, call_flops: float, batch_s: float) -> Dict[str, Any]:
    import jax
    import jax.numpy as jnp

    m, n, k = shape
    dtype, lax_precision, result = _precision_setup(precision)
    flops = 2.0 * m * n * k
    repeat = max(1, min(32, math.ceil(call_flops / flops)))
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * repeat)
    lhs = [jax.random.normal(keys[2 * i], (m, k), jnp.float32).astype(dtype) for i in range(repeat)]
    rhs = [jax.random.normal(keys[2 * i + 1], (k, n), jnp.float32).astype(dtype) for i in range(repeat)]

    @jax.jit
    def products(a, b):  # independent operands: nothing for XLA to merge or hoist
        return [jax.lax.dot(x, y, precision=lax_precision, preferred_element_type=result) for x, y in zip(a, b)]

    seconds = timed_batches(lambda: products(lhs, rhs), batch_s) / repeat
    return {"precision": precision, "m": m, "n": n, "k": k, "products_a_call": repeat, "seconds": seconds, "flops_s": flops / seconds}


def hbm_bandwidth(size_bytes: int, batch_s: float) -> Dict[str, Any]:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((size_bytes // 4,), jnp.float32)
    step = jax.jit(lambda v: v * 2.0 + 1.0)
    seconds = timed_batches(lambda: step(x), batch_s)
    moved = 2 * (size_bytes // 4) * 4
    return {
        "op": "y = 2x + 1, float32",
        "read_bytes": moved // 2,
        "written_bytes": moved // 2,
        "seconds": seconds,
        "bytes_s": moved / seconds,
    }


def _chain(length: int):
    import jax

    def chain(v):
        for _ in range(length):
            v = jax.lax.optimization_barrier(v + 1.0)  # the barrier keeps each add its own kernel
        return v

    return jax.jit(chain)


def launch_overhead(batch_s: float) -> Dict[str, Any]:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((256,), jnp.float32)
    long_chain, one = _chain(LAUNCH_CHAIN), _chain(1)
    chain_s = timed_batches(lambda: long_chain(x), batch_s)
    one_s = timed_batches(lambda: one(x), batch_s)
    identity = jax.jit(lambda v: v + 1.0)
    dispatch_s = timed_batches(lambda: identity(x), batch_s)
    return {
        "kernel_seconds": max(chain_s - one_s, 0.0) / (LAUNCH_CHAIN - 1),
        "chain": LAUNCH_CHAIN,
        "chain_seconds": chain_s,
        "dispatch_seconds": dispatch_s,
    }


def loop_floor(devices: int, on_gpu: bool, timeout_s: float) -> Dict[str, Any]:
    """The steady step time of the kit's loop over LOOP_MODEL on the first `devices` local devices (a
    process of its own: this one holds the GPUs' memory, so the child allocates as it goes)."""
    with tempfile.TemporaryDirectory(prefix="alpa-job-loop-floor-") as out:
        argv = [sys.executable, "-m", "alpa_job", "train", "--address", "none", "--steps", str(LOOP_STEPS)]
        argv += ["--compile-cache", "none", "--quiet", "--no-tensorboard", "--out", out, *LOOP_MODEL]
        argv += ["--batch-size", str(devices), "--strategy", "data"]
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        if not on_gpu:
            argv += ["--devices", str(devices)]  # the CPU devices this process measured, not the kit's default 8
        else:
            visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d] or [str(i) for i in range(devices)]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[:devices])
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
        try:
            with open(os.path.join(out, "report.json")) as f:
                steady = json.load(f)["timing"]["steady_step"]
        except (OSError, ValueError, KeyError, TypeError):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            raise RuntimeError(f"the training loop did not report a step time: {tail[0][:160]}") from None
    return {"devices": devices, "steps": LOOP_STEPS, "step_seconds": steady["median_s"], "p90_seconds": steady["p90_s"]}


def _shard_map(fn, mesh, in_spec, out_spec):
    import jax

    try:
        return jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False)
    except (AttributeError, TypeError):  # older jax
        from jax.experimental.shard_map import shard_map

        return shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_rep=False)


def collective_rate(kind: str, size_bytes: int, batch_s: float) -> Dict[str, Any]:
    """`size_bytes`: the buffer each device ends with (all-reduce: also the one it starts with)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = jax.local_devices()
    count = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    elements = size_bytes // 4 // count * count
    chain = max(1, min(COLLECTIVE_CHAIN, (64 * 2**20) // max(size_bytes, 1)))
    if kind == "all-reduce":

        def reduce_chain(v):
            for _ in range(chain):
                v = jax.lax.psum(v, "d") * (1.0 / count)  # each waits for the last; values stay put
            return v

        body = _shard_map(reduce_chain, mesh, P("d"), P("d"))
        global_elements, factor = elements * count, 2.0 * (count - 1) / count
    else:
        shard = elements // count

        def gather_chain(v):
            for _ in range(chain):
                v = jax.lax.all_gather(v, "d", tiled=True)[:shard] * 1.0
            return v

        body = _shard_map(gather_chain, mesh, P("d"), P("d"))
        global_elements, factor = elements, (count - 1) / count
    x = jax.device_put(jnp.ones((global_elements,), jnp.float32), NamedSharding(mesh, P("d")))
    step = jax.jit(body)
    seconds = timed_batches(lambda: step(x), batch_s) / chain
    nbytes = elements * 4
    return {
        "op": kind,
        "devices": count,
        "bytes": nbytes,
        "chain": chain,
        "seconds": seconds,
        "algbw_bytes_s": nbytes / seconds,
        "busbw_bytes_s": factor * nbytes / seconds,
    }


def precisions(device) -> List[str]:
    """The precisions this device multiplies in, by jax's platform and CUDA compute capability."""
    if device.platform != "gpu":
        return ["bf16", "fp32"]
    try:
        capability = float(getattr(device, "compute_capability", "0"))
    except ValueError:
        capability = 0.0
    out = ["bf16", "tf32" if capability >= 8.0 else "fp32"]
    if capability >= 8.9:
        out.append("fp8")
    if "fp32" not in out:
        out.append("fp32")
    return out


def device_memory_bytes(device) -> Optional[int]:
    """One device's total memory: nvidia-smi's, else None (jax reports only its own share)."""
    if device.platform != "gpu":
        return None
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=memory.total",
                "--format=csv,noheader,nounits",
                "-i",
                str(getattr(device, "local_hardware_id", None) or device.id),
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return int(float(out.stdout.split()[0]) * 2**20) if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def measure(
    budget_s: float = 90.0, shapes: Optional[List[Shape]] = None, stream=None, collectives: bool = True, loop: bool = True
) -> Dict[str, Any]:
    """The profile's measured part (gpu_profile.py's schema), on jax's default backend's local devices;
    `shapes`: these in every precision instead of the default grid."""
    import jax

    device = jax.local_devices()[0]
    on_gpu = device.platform == "gpu"
    pick = 0 if on_gpu else 1
    grid = {p: list(shapes) if shapes else (GPU_GRID if on_gpu else CPU_GRID).get(p, []) for p in precisions(device)}
    count = len(jax.local_devices())
    sizes = SIZES["collective_bytes"][pick] if collectives and count > 1 else ()
    batch_s, call_flops = SIZES["batch_s"][pick], SIZES["call_flops"][pick]
    loop_counts = sorted({1, count}) if on_gpu and loop else [count] if loop else []
    clock = Clock(budget_s, 2 + sum(map(len, grid.values())) + 2 * len(sizes) + len(loop_counts), stream)
    what = "its numbers are the CPU's, not a GPU's" if not on_gpu else f"{count} device(s)"
    print(
        f"[calibrate] {device.device_kind} ({device.platform}, jax {jax.__version__}): {what}; budget {budget_s:.0f} s",
        file=clock.stream,
        flush=True,
    )
    skipped: List[str] = []
    launch = launch_overhead(batch_s)
    clock.line(
        f"launch: {launch['kernel_seconds'] * 1e6:.2f} us a kernel in a program, {launch['dispatch_seconds'] * 1e6:.1f} us a jitted call"
    )
    hbm = hbm_bandwidth(SIZES["hbm_bytes"][pick], batch_s)
    clock.line(f"hbm: {_gbs(hbm['bytes_s'])} GB/s ({hbm['read_bytes'] / 2**20:.0f} MiB read + written)")
    order = [(p, s) for p in ("bf16",) for s in grid.get(p, [])]
    rest = [(p, s) for p in grid if p != "bf16" for s in grid[p]]
    matmul: List[Dict[str, Any]] = []
    comms: List[Dict[str, Any]] = []
    floors: List[Dict[str, Any]] = []
    jobs: List[Tuple[str, Any]] = [("matmul", j) for j in order]
    jobs += [("collective", (kind, size)) for size in sizes for kind in ("all-reduce", "all-gather")]
    jobs += [("loop", n) for n in loop_counts]
    jobs += [("matmul", j) for j in rest]
    for what, job in jobs:
        label = (
            f"matmul {job[0]} {'x'.join(map(str, job[1]))}"
            if what == "matmul"
            else f"the training loop's floor on {job} device(s)"
            if what == "loop"
            else f"{job[0]} {job[1] / 2**20:g} MiB over {count} devices"
        )
        if clock.over():
            skipped.append(label)
            clock.line(f"{label}: skipped (past the {budget_s:.0f} s budget)")
            continue
        try:
            if what == "matmul":
                row = matmul_rate(job[1], job[0], call_flops, batch_s)
                matmul.append(row)
                clock.line(f"{label}: {_tflops(row['flops_s'])} TFLOP/s")
            elif what == "loop":
                row = loop_floor(job, on_gpu, timeout_s=max(60.0, budget_s))
                floors.append(row)
                clock.line(f"{label}: {row['step_seconds'] * 1e3:.2f} ms a step")
            else:
                row = collective_rate(job[0], job[1], batch_s)
                comms.append(row)
                clock.line(f"{label}: bus {row['busbw_bytes_s'] / 1e9:.1f} GB/s")
        except Exception as err:  # noqa: BLE001 - a precision or collective this device or jax lacks: said, not fatal
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            skipped.append(f"{label}: {type(err).__name__}: {first}")
            clock.line(f"{label}: failed ({type(err).__name__}: {first})")
    peaks = {}
    for row in matmul:
        peaks[row["precision"]] = max(peaks.get(row["precision"], 0.0), row["flops_s"])
    bus = {}
    for row in comms:  # the largest size's: what a step's big gradient/parameter collectives reach
        if row["bytes"] >= bus.get(row["op"], {}).get("bytes", 0):
            bus[row["op"]] = {"bytes": row["bytes"], "busbw_bytes_s": row["busbw_bytes_s"], "devices": row["devices"]}
    return {
        "device_kind": device.device_kind,
        "platform": device.platform,
        "devices": count,
        "memory_bytes": device_memory_bytes(device),
        "measured_seconds": round(clock.elapsed(), 1),
        "peak_flops": peaks,
        "matmul": matmul,
        "hbm": hbm,
        "launch": launch,
        "collectives": comms,
        "collective_busbw": bus,
        "loop": floors,
        "skipped": skipped,
    }


def versions() -> Dict[str, str]:
    import jax

    out = {"jax": jax.__version__, "python": platform.python_version()}
    try:
        import jaxlib

        out["jaxlib"] = jaxlib.__version__
    except (ImportError, AttributeError):
        pass
    return out


def profile(
    budget_s: float, command: str, shapes: Optional[List[Shape]] = None, stream=None, collectives: bool = True, loop: bool = True
) -> Dict[str, Any]:
    measured = measure(budget_s, shapes, stream, collectives, loop)
    out = {
        "schema": gpu_profile.SCHEMA,
        "version": gpu_profile.VERSION,
        **measured,
        "versions": versions(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }
    if measured["platform"] != "gpu":
        out["note"] = "measured on a CPU: these are the CPU's numbers, not a GPU's; plan refuses this profile"
    gpu_profile.validate(out, "the profile just measured")  # what we write, plan can read
    return out


def table(prof: Dict[str, Any]) -> str:
    """The profile as the table RESULTS.md shows."""
    lines = [
        f"{prof['device_kind']} ({prof['platform']}, {prof['devices']} device(s), jax "
        f"{prof['versions']['jax']}), {prof['created']}, {prof['measured_seconds']} s",
        "",
        "| precision | M x N x K | TFLOP/s | products a call |",
        "|---|---|---|---|",
    ]
    for row in prof["matmul"]:
        lines.append(
            f"| {row['precision']} | {row['m']} x {row['n']} x {row['k']} | {_tflops(row['flops_s'])} | {row['products_a_call']} |"
        )
    hbm, launch = prof["hbm"], prof["launch"]
    lines += ["", "| measurement | value |", "|---|---|"]
    lines += [f"| best {p} | {_tflops(v)} TFLOP/s |" for p, v in prof["peak_flops"].items()]
    lines.append(f"| HBM ({hbm['op']}, {hbm['read_bytes'] / 2**20:.0f} MiB) | {_gbs(hbm['bytes_s'])} GB/s |")
    lines.append(f"| one more kernel in a program (chain of {launch['chain']}) | {launch['kernel_seconds'] * 1e6:.2f} us |")
    lines.append(f"| one jitted call from Python | {launch['dispatch_seconds'] * 1e6:.1f} us |")
    for row in prof["collectives"]:
        lines.append(f"| {row['op']} {row['bytes'] / 2**20:g} MiB, {row['devices']} devices | bus {row['busbw_bytes_s'] / 1e9:.1f} GB/s |")
    for row in prof.get("loop", []):
        lines.append(f"| the kit's training loop, near-empty step, {row['devices']} device(s) | {row['step_seconds'] * 1e3:.2f} ms |")
    lines += [f"| skipped | {s} |" for s in prof["skipped"]]
    return "\n".join(lines)


def _tflops(flops_s: float) -> str:
    return f"{flops_s / 1e12:.1f}" if flops_s >= 1e13 else f"{flops_s / 1e12:.3g}"


def _gbs(bytes_s: float) -> str:
    return f"{bytes_s / 1e9:.0f}" if bytes_s >= 1e11 else f"{bytes_s / 1e9:.3g}"


def default_path(device_kind: str) -> str:
    return os.path.join("plans", f"gpu-profile-{gpu_profile.slug(device_kind)}.json")


def build_parser(parser_class):
    p = parser_class(
        prog="python -m alpa_job plan calibrate",
        description="Measure the local accelerator with jax: dense matmul FLOP/s by shape and "
        "precision, HBM bandwidth, per-kernel launch overhead and, with several local "
        "GPUs, all-reduce/all-gather bus bandwidth. Writes a GPU profile that "
        "`python -m alpa_job plan --gpu-profile FILE` uses instead of the shipped numbers.",
    )
    p.add_argument("--out", metavar="FILE", help="where the profile goes (default: plans/gpu-profile-<kind>.json)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=90.0,
        metavar="S",
        help="seconds the measurements may take; what is left when it runs out is skipped and listed (default: 90)",
    )
    p.add_argument(
        "--shape",
        action="append",
        metavar="MxNxK",
        help="measure this matmul shape (in every precision) instead of the default grid, e.g. your model's 8192x2048x2048; repeatable",
    )
    p.add_argument("--no-collectives", action="store_true", help="skip the collectives even with several devices")
    p.add_argument("--no-loop", action="store_true", help="skip timing the kit's training loop over a near-empty model")
    return p


def parse_shape(text: str) -> Shape:
    try:
        m, n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise KitError(f"--shape {text!r} is not MxNxK (three positive integers, e.g. 8192x2048x2048)") from None
    if min(m, n, k) < 1:
        raise KitError(f"--shape {text!r} has a size < 1; give three positive integers, e.g. 8192x2048x2048")
    return m, n, k


def run(args, argv: Sequence[str]) -> int:
    if args.budget_s <= 0:
        raise KitError(f"--budget-s must be > 0, got {args.budget_s}")
    shapes = [parse_shape(s) for s in args.shape or ()]
    command = "python -m alpa_job " + " ".join(shlex.quote(a) for a in argv)
    prof = profile(args.budget_s, command, shapes=shapes or None, collectives=not args.no_collectives, loop=not args.no_loop)
    path = args.out or default_path(prof["device_kind"])
    gpu_profile.write(prof, path)
    print(table(prof), flush=True)
    print(f"profile: {path}  (python -m alpa_job plan ... --gpu-profile {path})", flush=True)
    return 0
