"""The kit's train step as XLA schedules it for 2 x H100, compiled on a machine with no GPU.

XLA can compile for a GPU it does not see (a "deviceless" compile, given the GPU's description), and the
compiled HLO's entry computation lists its instructions in the order they will run. From that order this
script reports, for each kind of collective, its bytes, how many matmuls run between its start and its
done (the compute it can hide behind), and how many of its bytes finish after the step's last matmul: the
tail that nothing overlaps. It answers "where did the collectives go" in a minute, without a GPU; how long
they take still needs one (bench/gpu_multi.py).

Needs JAX's CUDA plugin where the planner finds it (alpa_job/planner/gpu_target.py: `scripts/setup --test`
installs it); no GPU, no driver. Every XLA flag in $XLA_FLAGS applies, as on a GPU.

    python3 bench/gpu_schedule.py --strategy data [--data-update replicated] [--case gpt24] [--dump FILE]
    python3 bench/gpu_schedule.py --strategy pipeline --micro-batches 8 --batch-size 32 [--num-layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

from lib.checkout import REPO  # first: alpa_job from this checkout
from alpa_job.record import hlo
from alpa_job.record.hlo import shape_bytes


def entry_schedule(hlo_text: str):
    """(name, shape, opcode, operands and attributes) of each instruction of the entry computation, in the
    order they run."""
    body = re.search(r"^ENTRY .*?\{\n(.*?)^\}", hlo_text, re.S | re.M).group(1)
    return [inst for inst in map(hlo.parse_instruction, body.splitlines()) if inst is not None]


def is_matmul(opcode: str, rest: str) -> bool:
    return (opcode == "fusion" and ("gemm" in rest or "kind=kCustom" in rest)) or (
        opcode == "custom-call" and ("__cublas" in rest or "__cudnn" in rest)
    )


def overlap_report(hlo_text: str) -> dict:
    """Per collective kind: count, bytes (of the results), matmuls between each start and its done, and the
    bytes whose done comes after the last matmul."""
    ops = entry_schedule(hlo_text)
    matmuls = [i for i, (_, _, opcode, rest) in enumerate(ops) if is_matmul(opcode, rest)]
    first, last = (matmuls[0], matmuls[-1]) if matmuls else (len(ops), -1)
    started = {}  # a start's name -> its position
    finished = {kind: [] for kind in hlo.COLLECTIVE_KINDS}  # (start position, done position, done's shape)
    for i, (name, shape, opcode, rest) in enumerate(ops):
        kind, phase = hlo.collective_phase(opcode)
        if kind is None or phase == "sync":
            continue
        if phase == "start":
            started[name] = i
            continue
        start = hlo.start_operand(rest, started)
        finished[kind].append((started.pop(start, i), i, shape))
    report = {"matmuls": len(matmuls)}
    for kind, pairs in finished.items():
        if not pairs:
            continue
        hidden = sorted(sum(1 for m in matmuls if a < m < b) for a, b, _ in pairs)
        report[kind] = {
            "count": len(pairs),
            "bytes": sum(shape_bytes(shape) for _, _, shape in pairs),
            "matmuls_beside_each_median": hidden[len(hidden) // 2],
            "with_no_matmul_beside": hidden.count(0),
            "bytes_after_last_matmul": sum(shape_bytes(shape) for _, b, shape in pairs if b > last),
            "bytes_before_first_matmul": sum(shape_bytes(shape) for _, b, shape in pairs if b < first),
            "dtypes": sorted({d for _, _, shape in pairs for d in re.findall(r"([a-z][a-z0-9]*)\[", shape)}),
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="data")
    parser.add_argument("--data-update", default="sharded")
    parser.add_argument("--case", default="gpt24")
    parser.add_argument("--fsdp-gather", default="layer", choices=("layer", "xla"))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=0, help="pipeline: micro-batches (the kit's default: 4 a stage)")
    parser.add_argument("--num-layers", type=int, default=0, help="the case's layers, fewer to compile faster")
    parser.add_argument("--batch-size", type=int, default=0, help="global batch (default: the case's a device)")
    parser.add_argument("--dump", default="", help="write the compiled HLO here")
    parser.add_argument("--out", default=os.environ.get("OUT", os.path.join(REPO, "bench", "results")))
    args = parser.parse_args()
    from alpa_job.planner import gpu_target

    gpu_target.prepare()  # before JAX starts its backends: no driver here, no GPU to open

    from alpa_job.engines import jax_engine, memory_fit
    from alpa_job.record import jax_program
    from gpu_common import GPT_CASES, gpt_case
    from lib.results import save_result

    gpu_target.present_as_gpu()
    targets = gpu_target.devices("h100", args.devices)
    jax_engine.make_mesh = lambda shape, axes: gpu_target.mesh(targets, shape, axes)
    memory_fit.check_state_fits = lambda *a, **k: None  # it reads the local devices' memory: there are none
    mesh = (args.devices, 1) if args.strategy in ("data", "fsdp", "pipeline") else (1, args.devices)
    rows = args.batch_size or GPT_CASES[args.case]["batch_size"] * args.devices
    extra = {"num_layers": args.num_layers} if args.num_layers else {}
    if args.strategy == "pipeline":
        extra.update(micro_batches=args.micro_batches)
    config, model, batch = gpt_case(
        args.case,
        batch_size=rows,
        num_samples=rows,
        compile_cache="none",
        data_update=args.data_update,
        fsdp_gather=args.fsdp_gather,
        **extra,
    )
    engine = jax_engine.JaxEngine(config, model, batch, args.strategy, mesh)
    start = time.perf_counter()
    _jitted, lowered = engine._lower("train_step", engine._abstract_batch())
    compiled = lowered.compile()
    hlo_text = compiled.as_text()
    seconds = round(time.perf_counter() - start, 1)
    memory = jax_program.memory_analysis(compiled) or {}
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(hlo_text)
    report = overlap_report(hlo_text)
    peak_gb, state_gb = (memory.get(k, 0) / 1e9 for k in ("peak_estimate_bytes", "argument_size_in_bytes"))
    print(
        f"{args.devices} x H100 (compiled here in {seconds} s), {args.case}, {args.strategy} "
        f"({args.data_update} update), XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
        f"{report['matmuls']} matmuls; XLA's peak estimate {peak_gb:.2f} GB a GPU (state {state_gb:.2f} GB)"
    )
    print(
        f"{'collective':16s} {'count':>6s} {'GB':>7s} {'dtypes':>10s} {'matmuls beside (median)':>24s} "
        f"{'none beside':>12s} {'GB before first matmul':>23s} {'GB after last matmul':>21s}"
    )
    for kind in hlo.COLLECTIVE_KINDS:
        if kind in report:
            r = report[kind]
            print(
                f"{kind:16s} {r['count']:6d} {r['bytes'] / 1e9:7.2f} {','.join(r['dtypes']):>10s} "
                f"{r['matmuls_beside_each_median']:24d} {r['with_no_matmul_beside']:12d} "
                f"{r['bytes_before_first_matmul'] / 1e9:23.2f} {r['bytes_after_last_matmul'] / 1e9:21.2f}"
            )
    print(json.dumps(report))
    print(
        "saved",
        save_result(
            "gpu_schedule",
            args.out,
            {
                "target": "2 x H100 (deviceless compile)",
                "case": args.case,
                "strategy": args.strategy,
                "data_update": args.data_update,
                "fsdp_gather": args.fsdp_gather,
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
                "compile_s": seconds,
                "memory": memory,
                "report": report,
            },
        ),
    )


if __name__ == "__main__":
    main()
