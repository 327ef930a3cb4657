"""The kit's train step as XLA schedules it for 2 x H100, compiled on a machine with no GPU.

XLA can compile for a GPU it does not see (a "deviceless" compile, given the GPU's description), and the
compiled HLO's entry computation lists its instructions in the order they will run. From that order this
script reports, for each kind of collective, its bytes, how many matmuls run between its start and its
done (the compute it can hide behind), and how many of its bytes finish after the step's last matmul: the
tail that nothing overlaps. It answers "where did the collectives go" in a minute, without a GPU; how long
they take still needs one (bench/gpu_multi.py).

Needs JAX's CUDA plugin (`pip install "jax[cuda13]"` at the kit's jax version, about 4.5 GB) in the
Python that runs it; no GPU, no driver. Every XLA flag in $XLA_FLAGS applies, as on a GPU.

    python3 bench/gpu_schedule.py --strategy data [--variant bf16-gather] [--case gpt24] [--dump FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

# What XLA needs to know of an H100 SXM to compile for it (the values nvidia-smi and the CUDA
# device query report for the lent H100s).
H100_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}
_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape text: one array or a tuple of them."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += _BYTES.get(dtype, 4) * count
    return total


def entry_schedule(hlo: str):
    """[(op, shape text, line)] of the entry computation, in the order it runs."""
    body = re.search(r"^ENTRY .*?\{\n(.*?)^\}", hlo, re.S | re.M).group(1)
    ops = []
    for line in body.splitlines():
        head = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = ", line)
        if not head:
            continue
        rest = line[head.end():]
        op = re.search(r"([a-z][a-z0-9\-]*)\((?:%|\))", rest)  # the opcode: the first name applied to operands
        if op:
            ops.append((op.group(1), rest[:op.start()], line))
    return ops


def is_matmul(op: str, line: str) -> bool:
    return (op == "fusion" and ("gemm" in line or "kind=kCustom" in line)) or \
        (op == "custom-call" and ("__cublas" in line or "__cudnn" in line))


def overlap_report(hlo: str) -> dict:
    """Per collective kind: count, bytes (of the results), matmuls between each start and its done, and the
    bytes whose done comes after the last matmul."""
    ops = entry_schedule(hlo)
    matmuls = [i for i, (op, _, line) in enumerate(ops) if is_matmul(op, line)]
    last = matmuls[-1] if matmuls else -1
    report = {"matmuls": len(matmuls)}
    for kind in _COLLECTIVES:
        starts = [i for i, (op, _, _) in enumerate(ops) if op == f"{kind}-start"]
        dones = [i for i, (op, _, _) in enumerate(ops) if op == f"{kind}-done"]
        if not dones:
            continue
        hidden = [sum(1 for m in matmuls if a < m < b) for a, b in zip(starts, dones)]
        sizes = [shape_bytes(ops[i][1]) for i in dones]
        report[kind] = {"count": len(dones), "bytes": sum(sizes),
                        "matmuls_beside_each_median": sorted(hidden)[len(hidden) // 2] if hidden else 0,
                        "with_no_matmul_beside": sum(1 for h in hidden if h == 0),
                        "bytes_after_last_matmul": sum(s for i, s in zip(dones, sizes) if i > last),
                        "dtypes": sorted({d for i in dones for d in re.findall(r"\b([a-z]+\d*)\[", ops[i][1])})}
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="data")
    parser.add_argument("--variant", choices=("kit", "bf16-gather"), default="kit")
    parser.add_argument("--data-update", default="sharded")
    parser.add_argument("--case", default="gpt24")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--dump", default="", help="write the compiled HLO here")
    parser.add_argument("--out", default=os.environ.get("OUT", os.path.join(REPO, "bench", "results")))
    args = parser.parse_args()
    # Before JAX starts its backends: no driver here to report CUDA's version, and no GPU to open.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

    from jax.experimental import topologies

    from alpa_job.engines import jax_engine, memory_fit
    from alpa_job.engines.sharding_rules import MESH_AXES
    from alpa_job.record import jax_program
    from gpu_common import GPT_CASES, gpt_case, save_result

    topology = topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET,
                                            topology=f"1x1x{args.devices}")
    jax_engine.make_mesh = lambda shape: topologies.make_mesh(topology, shape, MESH_AXES)
    memory_fit.check_state_fits = lambda *a, **k: None  # it reads the local devices' memory: there are none
    if args.variant == "bf16-gather":
        import data_bf16_gather

        data_bf16_gather.install()
    mesh = (args.devices, 1) if args.strategy in ("data", "fsdp") else (1, args.devices)
    rows = GPT_CASES[args.case]["batch_size"] * args.devices
    config, model, batch = gpt_case(args.case, batch_size=rows, num_samples=rows, compile_cache="none",
                                    data_update=args.data_update)
    engine = jax_engine.JaxEngine(config, model, batch, args.strategy, mesh)
    start = time.perf_counter()
    _jitted, lowered = engine._lower("train_step", engine._abstract_batch())
    compiled = lowered.compile()
    hlo = compiled.as_text()
    seconds = round(time.perf_counter() - start, 1)
    memory = jax_program.memory_analysis(compiled) or {}
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(hlo)
    report = overlap_report(hlo)
    peak_gb, state_gb = (memory.get(k, 0) / 1e9 for k in ("peak_estimate_bytes", "argument_size_in_bytes"))
    print(f"{args.devices} x H100 (compiled here in {seconds} s), {args.case}, {args.strategy} "
          f"({args.data_update} update), {args.variant}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
          f"{report['matmuls']} matmuls; XLA's peak estimate {peak_gb:.2f} GB a GPU (state {state_gb:.2f} GB)")
    print(f"{'collective':16s} {'count':>6s} {'GB':>7s} {'dtypes':>10s} {'matmuls beside (median)':>24s} "
          f"{'none beside':>12s} {'GB after last matmul':>21s}")
    for kind in _COLLECTIVES:
        if kind in report:
            r = report[kind]
            print(f"{kind:16s} {r['count']:6d} {r['bytes'] / 1e9:7.2f} {','.join(r['dtypes']):>10s} "
                  f"{r['matmuls_beside_each_median']:24d} {r['with_no_matmul_beside']:12d} "
                  f"{r['bytes_after_last_matmul'] / 1e9:21.2f}")
    print(json.dumps(report))
    print("saved", save_result("gpu_schedule", args.out, {
        "target": "2 x H100 (deviceless compile)", "case": args.case, "strategy": args.strategy,
        "variant": args.variant, "data_update": args.data_update, "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "compile_s": seconds, "memory": memory, "report": report}))


if __name__ == "__main__":
    main()
