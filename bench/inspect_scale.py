"""`python -m alpa_job inspect` on a report with 10,000 leaves (a mixture-of-experts GPT): wall time per format.

Target (issue 26): every format (table, json, md, html) <= 2 s and `inspect --compare A B` <= 3 s on a
2-core machine. The report is built from the real record types (alpa_job.record.run_record): a GPT
with mixture-of-experts layers, its Adam state (mu, nu per parameter), 2 processes, 1,000 losses,
the timing record and eval points, checked against the report's JSON schema when jsonschema is there.
Each command runs in a fresh process (imports included: what a user waits for), `--repeats` times;
the table shows the median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import List

from lib.checkout import REPO  # first: alpa_job from this checkout (the report is built in-process)
from lib.results import record
from lib.table import print_table

FORMAT_TARGET_S = 2.0
COMPARE_TARGET_S = 3.0


def moe_param_names(layers: int, experts: int) -> List[str]:
    """A mixture-of-experts GPT's parameter paths (flax style), embedding first."""
    names = ["embed/embedding", "pos_embed/embedding", "final_norm/scale", "final_norm/bias"]
    for i in range(layers):
        layer = f"layer_{i}"
        names += [
            f"{layer}/{n}"
            for n in (
                "attention/query/kernel",
                "attention/key/kernel",
                "attention/value/kernel",
                "attention/out/kernel",
                "attention_norm/scale",
                "mlp_norm/scale",
                "moe/router/kernel",
            )
        ]
        for e in range(experts):
            names += [f"{layer}/moe/expert_{e}/{n}" for n in ("wi/kernel", "wi/bias", "wo/kernel", "wo/bias")]
    return names


def build_record(leaves: int = 10_000, seed_tag: str = "a", steps: int = 1000):
    """A RunRecord with exactly `leaves` plan leaves: step, params, Adam's mu and nu, count."""
    from alpa_job.record.run_record import (
        DeviceInfo,
        EvalPoint,
        Leaf,
        MemoryRecord,
        MeshRecord,
        MeshShape,
        ProcessInfo,
        ProcessResult,
        RunRecord,
        Collective,
    )

    n_params = (leaves - 2) // 3  # + mu + nu per parameter, + step and the optimizer's counters
    d_model, d_ff = 4096, 14336
    names: List[str] = []
    experts = 32
    layers = 1
    while len(names) < n_params:
        layers += 1
        names = moe_param_names(layers, experts)
    names = names[:n_params]

    def shape_of(name: str) -> List[int]:
        if name.endswith("embedding"):
            return [50304 if name.startswith("embed") else 2048, d_model]
        if "/wi/kernel" in name:
            return [d_model, d_ff]
        if "/wo/kernel" in name:
            return [d_ff, d_model]
        if "/wi/bias" in name:
            return [d_ff]
        if name.endswith("router/kernel"):
            return [d_model, experts]
        if name.endswith("kernel"):
            return [d_model, d_model]
        return [d_model]

    def leaf(path: str, shape: List[int]) -> Leaf:
        n = 4
        for d in shape:
            n *= d
        expert = "/expert_" in path and "kernel" in path
        spec = "P('expert', None, 'model')" if expert else ("P(None, 'model')" if len(shape) == 2 else "P()")
        split = [["expert"], [], ["model"]][: len(shape)] if expert else [[] for _ in shape]
        return Leaf(
            path=path,
            shape=shape,
            dtype="float32",
            bytes=n,
            bytes_per_device=n // (8 if expert else 2),
            spec=spec,
            mesh_ids=[0],
            split_axes=split,
            strategy="MP+ZeRO" if expert else "MP",
        )

    rows = [leaf("step", [])]
    rows += [leaf("params/" + n, shape_of(n)) for n in names]
    for moment in ("mu", "nu"):
        rows += [leaf(f"opt_state/0/{moment}/{n}", shape_of(n)) for n in names]
    # the optimizer chain's counters (one per transform: clip, adam, schedule, ...) fill the rest
    rows += [leaf(f"opt_state/{i}/count", []) for i in range(leaves - len(rows))]
    assert len(rows) == leaves, (len(rows), leaves)
    speed = 1.0 if seed_tag == "a" else 1.1
    results = []
    for pid in range(2):
        results.append(
            ProcessResult(
                engine="jax",
                strategy="fsdp",
                requested_strategy="auto",
                mesh=MeshShape([2, 8], ["data", "model"]),
                meshes=[MeshRecord(id=0, shape=[2, 8], axes=["data", "model"], batch_axes=["data"], devices=16)],
                params=rows,
                batch_sharding=[leaf("batch/tokens", [64, 2048])],
                compiles=1,
                backend_compiles_during_loop=0,
                compile_seconds=41.2 * speed,
                collectives=Collective.table(
                    {
                        "all-reduce": {"count": 812, "bytes": 9 << 30},
                        "all-gather": {"count": 401, "bytes": 7 << 30},
                        "reduce-scatter": {"count": 399, "bytes": 6 << 30},
                    }
                ),
                memory=MemoryRecord.from_plain(
                    {"argument_size_in_bytes": 61 << 30, "temp_size_in_bytes": 9 << 30, "peak_estimate_bytes": 70 << 30}
                ),
                process=ProcessInfo(
                    id=pid,
                    count=2,
                    host=f"gpu{pid}",
                    ip=f"10.0.0.{pid + 1}",
                    local_devices=[f"cuda:{i}" for i in range(8)],
                    coordinator="10.0.0.1:24999",
                ),
                devices=DeviceInfo(count=16, platform="gpu", kind="NVIDIA H100 80GB HBM3"),
                versions={"python": "3.11.7", "jax": "0.10.2"},
                steps=steps,
                samples_seen=steps * 64,
                loop_seconds=steps * 0.9 * speed,
                step_time_s=0.9 * speed,
                throughput=64 / (0.9 * speed),
                losses=[10.0 * (0.999**i) for i in range(steps)],
                evals=[EvalPoint(s, 5.0 - s / 1000, 100.0 - s / 20, 8) for s in range(100, steps + 1, 100)],
                timing={
                    "phases_s": {"compile": 41.2 * speed, "first_step": 2.1, "to_first_step": 55.0},
                    "steady_step": {"median_s": 0.9 * speed, "p10_s": 0.88, "p90_s": 0.93, "windows": 50},
                    "flops_per_step": 3.1e15,
                    "tflops_per_device": 220.0,
                    "mfu": 0.41,
                },
            )
        )
    rec = RunRecord.from_processes(results, {"model": "gpt-moe-%s" % seed_tag, "steps": steps}, created="2026-01-01T00:00:00Z")
    return rec


def write_report(path: str, **kw) -> str:
    """Build the record and write it as report.json in folder `path`; returns `path`."""
    from alpa_job.record.report_file import REPORT_FILE, report_json

    rec = build_record(**kw)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, REPORT_FILE), "w") as f:
        f.write(report_json(rec))
    return path


def _validate(path: str) -> str:
    try:
        import jsonschema
    except ImportError:
        return "not checked (no jsonschema)"
    import json

    from alpa_job.record.run_record import load_schema

    with open(os.path.join(path, "report.json")) as f:
        data = json.load(f)
    errors = list(jsonschema.Draft202012Validator(load_schema()).iter_errors(data))
    if errors:
        sys.exit("the generated report does not match the schema: %s" % errors[0].message)
    return "valid"


def _time(argv: List[str], cwd: str) -> tuple:
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="160")
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "alpa_job"] + argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - start
    if p.returncode != 0:
        sys.exit("%s failed (rc %d):\n%s" % (" ".join(argv), p.returncode, p.stderr[-2000:]))
    return wall, len(p.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-record", action="store_true", help="print only; write nothing under bench/")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench-inspect-")
    a = write_report(os.path.join(work, "A"), leaves=args.leaves, seed_tag="a")
    b = write_report(os.path.join(work, "B"), leaves=args.leaves, seed_tag="b")
    schema = _validate(a)
    cases = [
        ("table", ["inspect", a], FORMAT_TARGET_S),
        ("table --all-rows", ["inspect", a, "--all-rows"], FORMAT_TARGET_S),
        ("json", ["inspect", a, "--format", "json"], FORMAT_TARGET_S),
        ("md", ["inspect", a, "--format", "md"], FORMAT_TARGET_S),
        ("html", ["inspect", a, "--format", "html", "--output", os.path.join(work, "a.html")], FORMAT_TARGET_S),
        ("compare table", ["inspect", "--compare", a, b], COMPARE_TARGET_S),
        ("compare html", ["inspect", "--compare", a, b, "--format", "html", "--output", os.path.join(work, "c.html")], COMPARE_TARGET_S),
    ]
    rows, raw = [], {}
    for name, argv, target in cases:
        walls, size = [], 0
        for _ in range(args.repeats):
            wall, size = _time(argv, work)
            walls.append(wall)
        if name in ("html", "compare html"):
            size = os.path.getsize(argv[argv.index("--output") + 1])
        med = statistics.median(walls)
        raw[name] = {"walls_s": [round(w, 3) for w in walls], "median_s": round(med, 3), "output_chars": size, "target_s": target}
        rows.append((name, "%.2f" % med, "%.2f" % min(walls), size, "%.0f" % target, "yes" if med <= target else "NO"))
    print("report: %d leaves, %s; %d runs each, fresh process" % (args.leaves, schema, args.repeats))
    table = print_table(("inspect", "median s", "min s", "output chars", "target s", "met"), rows)
    if not args.no_record:
        path = record(
            "inspect_scale",
            {"leaves": args.leaves, "cases": raw},
            table,
            "inspect on a %d-leaf report, fresh process per run" % args.leaves,
        )
        print("saved", path)


if __name__ == "__main__":
    main()
