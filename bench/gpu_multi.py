"""Several GPUs: the kit's strategies against a plain-jit data-parallel peer, one machine, one call.

Runs (each in a fresh process, so every one compiles cold and owns the GPUs' memory):
- `1gpu`: the kit, `--strategy data` on GPU 0 alone at the per-GPU batch: the scaling baseline;
- `peer`: the competent peer (gpu_peer.py's loop) data-parallel over every GPU, params replicated and
  the batch split with a NamedSharding - what a user writes for several GPUs without the kit;
- `RUN=STRATEGY[+xla:FLAGS]`: `python3 -m alpa_job train --address none --preset P --strategy S
  --batch-size B --profile ...` with optional extra XLA flags; the report gives the steady step, the
  peak memory and the profiled communication share. `+pgle` runs it twice, the second time scheduled by
  the first one's profile (XLA's profile-guided latency estimator).
Scaling efficiency = 1-GPU step time / n-GPU step time at n times the batch (ideal: 1.0).

    python3 bench/gpu_multi.py --preset gpt-24l --per-gpu-batch 8 --runs data fsdp tensor
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from lib.results import save_result

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PEER = r"""
import json, sys, time, statistics
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
sys.path.insert(0, %(bench)r)
import gpu_peer
cfg = json.loads(%(cfg)r)
n = jax.device_count()
mesh = Mesh(np.array(jax.devices()), ("data",))
rng = np.random.default_rng(0)
tokens = rng.integers(0, cfg["vocab_size"], (cfg["batch"], cfg["seq_len"] + 1)).astype(np.int32)
tokens = jax.device_put(tokens, NamedSharding(mesh, P("data")))
replicated = NamedSharding(mesh, P())
params = jax.device_put(gpu_peer.init_params(jax.random.PRNGKey(0), cfg["num_layers"], cfg["d_model"],
                                             cfg["vocab_size"], cfg["seq_len"], cfg["num_heads"]), replicated)
tx = optax.adam(1e-4)
opt_state = jax.device_put(tx.init(params), replicated)
step = jax.jit(gpu_peer.train_step(tx, cfg["num_heads"]), donate_argnums=(0, 1) if cfg["donate"] else ())
t = time.perf_counter()
params, opt_state, loss = step(params, opt_state, tokens); jax.block_until_ready(loss)
compile_s = time.perf_counter() - t
times = []
for _ in range(cfg["repeats"]):
    t = time.perf_counter()
    for _ in range(cfg["steps"]):
        params, opt_state, loss = step(params, opt_state, tokens)
    jax.block_until_ready(loss)
    times.append((time.perf_counter() - t) / cfg["steps"])
peak = max(int((d.memory_stats() or {}).get("peak_bytes_in_use", 0)) for d in jax.local_devices())
print("RESULT", json.dumps({"step_ms": statistics.median(times) * 1e3, "compile_s": compile_s, "peak_gb": peak / 1e9,
                            "devices": n}))
"""


def run(cmd, env, timeout) -> tuple:
    """(the finished process, seconds); one that outlives `timeout` comes back as a failed process, so
    one stuck run costs its own row, not the rows of every run before it."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (err.stdout, err.stderr))
        proc = subprocess.CompletedProcess(cmd, 124, output, f"timed out after {timeout} s")
    return proc, round(time.perf_counter() - start, 1)


# A variant of the kit for one run: tensor with sequence parallelism between blocks (the sequence
# of the activations a block hands on split over "model" too; the kit's rules keep it whole).
SEQUENCE_PARALLEL = (
    "import dataclasses, runpy, sys; import alpa_job.strategies as s; "
    "s.STRATEGIES['tensor'] = dataclasses.replace(s.TENSOR, activation_rules="
    "s.TENSOR.activation_rules + [('seq', 'model')]); "
    "sys.argv = ['alpa_job'] + sys.argv[1:]; runpy.run_module('alpa_job', run_name='__main__')"
)


def kit_run(args, name: str, strategy: str, batch: int, extra_flags: str, env, gpus: str = None, variant: str = "", more_args=()) -> dict:
    out = os.path.join(args.scratch, name)
    shutil.rmtree(out, ignore_errors=True)
    env = dict(env)
    if extra_flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + extra_flags).strip()
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    launcher = {"seq-parallel": ["-c", SEQUENCE_PARALLEL]}.get(variant, ["-m", "alpa_job"])
    cmd = [
        sys.executable,
        *launcher,
        "train",
        "--address",
        "none",
        "--preset",
        args.preset,
        "--strategy",
        strategy,
        "--batch-size",
        str(batch),
        "--num-samples",
        str(batch * 4),
        "--steps",
        str(args.steps),
        "--out",
        out,
    ]
    if args.profile and gpus is None:
        cmd += ["--profile", args.profile]
    cmd += args.kit_args + list(more_args)
    proc, wall = run(cmd, env, args.timeout)
    if proc.returncode != 0:
        return {"run": name, "wall_s": wall, "error": (proc.stdout + proc.stderr)[-3000:]}
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    timing = report["timing"]
    profile = timing.get("profile") or {}
    row = {
        "run": name,
        "strategy": report["strategy"],
        "mesh": report["mesh"],
        "batch": batch,
        "step_ms": round(timing["steady_step"]["median_s"] * 1e3, 2),
        "mfu": timing.get("mfu"),
        "peak_gb": round((timing.get("peak_memory_bytes") or 0) / 1e9, 2),
        "estimate_gb": round((timing.get("peak_estimate_bytes") or 0) / 1e9, 2),
        "to_first_step_s": timing["phases_s"].get("to_first_step"),
        "wall_s": wall,
        "comm_share": profile.get("comm_share"),
        "exposed_comm_share": profile.get("exposed_comm_share"),
        "collective_ms_per_step": profile.get("collective_ms_per_step"),
        "xla_flags": extra_flags,
        "search": report.get("search"),
        "collectives": report.get("collectives"),
        # Start to the last step's end: the whole run's cost, not only its start.
        "to_end_s": _to_end(timing["phases_s"], report["loop_seconds"]),
        "steps": report["steps"],
        "phases_s": timing["phases_s"],
    }
    if args.keep_traces and profile.get("trace"):
        dest = os.path.join(args.out, "traces", f"{name}.trace.json.gz")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy(profile["trace"], dest)
    return row


PGLE_STEPS = "10:3"  # the steps the profile-guided run's first run traces (after its warm-up)


def _with_pgle_profile(args, name: str, strategy: str, batch: int, flags: str, env, rows) -> str:
    """Profile-guided latency estimation (JAX-Toolbox's PGLE): run once with a profile, turn the trace into
    XLA's profiled-instructions proto, and return `flags` plus the flag that schedules the step by it."""
    from jax.experimental import profiler

    first = kit_run(args, f"{name}-profiled", strategy, batch, flags, env, more_args=("--profile", PGLE_STEPS))
    rows.append(first)
    print(json.dumps({k: v for k, v in first.items() if k not in ("search", "collectives")}), flush=True)
    trace = os.path.join(args.scratch, f"{name}-profiled", "profile")
    run_dirs = sorted(glob.glob(os.path.join(trace, "plugins", "profile", "*")))
    if not run_dirs:
        print(f"pgle: the profiled run wrote no trace under {trace}; {name} runs without a profile", flush=True)
        return flags
    path = os.path.join(args.scratch, f"{name}.pgle.pb")
    with open(path, "wb") as f:
        f.write(profiler.get_profiled_instructions_proto(run_dirs[-1]))
    print(f"pgle profile {path}: {os.path.getsize(path)} bytes", flush=True)
    return (flags + f" --xla_gpu_pgle_profile_file_or_directory_path={path}").strip()


def _to_end(phases: dict, loop_seconds: float):
    if phases.get("to_first_step") is None or phases.get("first_step") is None:
        return None
    return round(phases["to_first_step"] - phases["first_step"] + loop_seconds, 2)


def peer_run(args, batch: int, env, donate: bool) -> dict:
    """The peer data-parallel over every GPU (PEER above), in a fresh process."""
    from gpu_common import GPT_CASES  # noqa: F401 - the bench's model table; the preset names the same sizes
    import yaml

    preset = {}
    name = args.preset
    while name:  # a preset's base_config chain, the last one loaded first
        with open(os.path.join(REPO, "alpa_job", "settings", "presets", f"{name}.yaml")) as f:
            layer = yaml.safe_load(f)
        preset = {**layer, **preset}
        name = layer.get("base_config")
    cfg = {k: preset[k] for k in ("num_layers", "d_model", "num_heads", "seq_len", "vocab_size")}
    cfg.update(batch=batch, steps=args.steps // 2, repeats=3, donate=donate)
    code = PEER % {"bench": os.path.join(REPO, "bench"), "cfg": json.dumps(cfg)}
    proc, wall = run([sys.executable, "-c", code], env, args.timeout)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        return {"run": "peer", "wall_s": wall, "error": (proc.stdout + proc.stderr)[-3000:]}
    result = json.loads(line[0][len("RESULT ") :])
    return {
        "run": "peer" + ("+donate" if donate else ""),
        "strategy": "peer data",
        "batch": batch,
        "step_ms": round(result["step_ms"], 2),
        "peak_gb": round(result["peak_gb"], 2),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="gpt-24l")
    parser.add_argument("--per-gpu-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile", default="30:3", help="START:COUNT for the kit runs ('' for none)")
    parser.add_argument(
        "--runs",
        nargs="*",
        default=["data", "fsdp", "tensor"],
        help="STRATEGY or NAME=STRATEGY[+xla:FLAG,FLAG][+env:K=V,K=V][+args:--flag,value][+seq-parallel][+pgle]",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the 1-GPU run")
    parser.add_argument("--peer", choices=("none", "plain", "donate", "both"), default="plain")
    parser.add_argument("--kit-args", nargs="*", default=[], help="extra train flags for every kit run")
    parser.add_argument("--keep-traces", action="store_true")
    parser.add_argument("--timeout", type=int, default=400)
    parser.add_argument("--scratch", default=None)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()
    args.scratch = args.scratch or tempfile.mkdtemp(prefix="gpumulti-")
    env = dict(os.environ, PYTHONPATH=REPO)
    import jax

    n = jax.device_count()
    kind = jax.devices()[0].device_kind
    rows = []
    if not args.no_baseline:
        rows.append(kit_run(args, "1gpu", "data", args.per_gpu_batch, "", env, gpus="0"))
        print(json.dumps(rows[-1]), flush=True)
    if args.peer in ("plain", "both"):
        rows.append(peer_run(args, args.per_gpu_batch * n, env, donate=False))
        print(json.dumps(rows[-1]), flush=True)
    if args.peer in ("donate", "both"):
        rows.append(peer_run(args, args.per_gpu_batch * n, env, donate=True))
        print(json.dumps(rows[-1]), flush=True)
    for spec in args.runs:
        head, *extras = spec.split("+")
        name, _, strategy = head.rpartition("=")
        flags = " ".join(e[len("xla:") :].replace(",", " ") for e in extras if e.startswith("xla:"))
        run_env = dict(env, **dict(kv.split("=", 1) for e in extras if e.startswith("env:") for kv in e[len("env:") :].split(",")))
        variant = "seq-parallel" if "seq-parallel" in extras else ""
        more = [a for e in extras if e.startswith("args:") for a in e[len("args:") :].split(",")]
        if "pgle" in extras:
            flags = _with_pgle_profile(args, name or strategy, strategy, args.per_gpu_batch * n, flags, run_env, rows)
        rows.append(kit_run(args, name or strategy, strategy, args.per_gpu_batch * n, flags, run_env, variant=variant, more_args=more))
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("search", "collectives")}), flush=True)
    base = next((r["step_ms"] for r in rows if r["run"] == "1gpu" and "step_ms" in r), None)
    print(f"\n{n} x {kind}, {args.preset}, {args.per_gpu_batch} sequences per GPU")
    print(
        f"{'run':28s} {'step ms':>8s} {'scaling':>8s} {'peak GB':>8s} {'est GB':>7s} {'MFU':>6s} "
        f"{'comm':>6s} {'exposed':>8s} {'first s':>8s} {'end s':>7s}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['run']:28s} ERROR {r['error'][-300:]!r}")
            continue
        scaling = base / r["step_ms"] if base and r["run"] != "1gpu" else None
        r["scaling"] = round(scaling, 3) if scaling else None

        def f(v, fmt):
            return format(v, fmt) if isinstance(v, (int, float)) else "-"

        print(
            f"{r['run']:28s} {f(r['step_ms'], '8.2f')} {f(scaling, '8.3f')} {f(r.get('peak_gb'), '8.2f')} "
            f"{f(r.get('estimate_gb'), '7.2f')} {f(r.get('mfu'), '6.3f')} {f(r.get('comm_share'), '6.3f')} "
            f"{f(r.get('exposed_comm_share'), '8.3f')} {f(r.get('to_first_step_s'), '8.1f')} "
            f"{f(r.get('to_end_s'), '7.1f')}"
        )
    print(
        "saved",
        save_result("gpu_multi", args.out, {"preset": args.preset, "devices": n, "rows": rows, "per_gpu_batch": args.per_gpu_batch}),
    )


if __name__ == "__main__":
    main()
