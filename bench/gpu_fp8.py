"""fp8 against bf16 on one GPU, through the kit's own command line (`python -m alpa_job train --address none`).

    python3 bench/gpu_fp8.py speed      # step time, tokens/s a GPU and MFU: GPT 24L and a LLaMA-3.2-1B shape
    python3 bench/gpu_fp8.py loss       # 500 steps of a ~1B LLaMA on a real token file, bf16 then fp8

`speed` trains each case twice in the same call, `--precision dtype` (bf16) then `--precision fp8`, and reads
the reports' steady step times. `loss` tokenizes real text (the installed Python packages' own source, bytes
tokenizer) with `data tokenize`, trains the same model from the same seed in each precision, and compares the
loss curves (the mean of the last 20 steps). Results: a table here and JSON (+ a PNG of the curves) in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from lib.results import save_result

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(REPO, "examples", "llama")

LLAMA_1B = ["num_layers=16", "d_model=2048", "num_heads=32", "num_kv_heads=8", "mlp_dim=8192"]
CASES = {
    "gpt24": ["--preset", "gpt-24l", "--batch-size", "16"],
    "llama3.2-1b": ["--preset", "llama3.2-1b", "--model-arg", "seq_len=2048", "--batch-size", "8"],
}


def train(out: str, precision: str, args, steps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, LLAMA]))
    cmd = [
        sys.executable,
        "-m",
        "alpa_job",
        "train",
        "--address",
        "none",
        "--dtype",
        "bfloat16",
        "--precision",
        precision,
        "--steps",
        str(steps),
        "--out",
        out,
        "--overwrite",
        "--compile-cache",
        "none",
        "--quiet",
        *args,
    ]
    started = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    report["bench_wall_s"] = round(time.perf_counter() - started, 1)
    report["bench_command"] = " ".join(cmd[1:])
    return report


def row(name: str, precision: str, report: dict) -> dict:
    t = report["timing"]
    steady = t.get("steady_step") or {}
    return {
        "case": name,
        "precision": precision,
        "step_ms": round(steady.get("median_s", float("nan")) * 1e3, 1),
        "tokens_per_s_per_device": t.get("tokens_per_s_per_device"),
        "mfu": t.get("mfu"),
        "peak": t.get("peak"),
        "loss_last": report["summary"]["loss_last"],
        "wall_s": report["bench_wall_s"],
        "command": report["bench_command"],
    }


def speed(args) -> dict:
    rows = []
    for name in args.cases:
        for precision in ("dtype", "fp8"):
            report = train(os.path.join(args.work, f"{name}-{precision}"), precision, CASES[name], args.steps)
            rows.append(row(name, precision, report))
            r = rows[-1]
            print(
                f"{name:12s} {precision:6s} step {r['step_ms']:8.1f} ms  {r['tokens_per_s_per_device']} tokens/s/GPU  "
                f"MFU {r['mfu']}  ({r['peak']['precision']} peak)",
                flush=True,
            )
        bf16, fp8 = rows[-2]["step_ms"], rows[-1]["step_ms"]
        print(f"{name:12s} fp8 speed-up {bf16 / fp8:.3f}x", flush=True)
    return {"rows": rows}


def tokens(work: str) -> str:
    """Real text to tokens: the jax package's own Python source, one document a file (bytes tokenizer)."""
    import jax

    source = os.path.join(os.path.dirname(jax.__file__), "**", "*.py")
    out = os.path.join(work, "jax-source.bin")
    p = subprocess.run(
        [sys.executable, "-m", "alpa_job", "data", "tokenize", source, "--out", out],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    if p.returncode != 0:
        raise SystemExit(p.stderr[-2000:])
    print(p.stdout.strip(), flush=True)
    return out


def loss(args) -> dict:
    data = tokens(args.work)
    model = [
        "--model",
        "llama_example.model:build",
        *sum((["--model-arg", a] for a in LLAMA_1B), []),
        "--model-arg",
        "vocab_size=257",
        "--model-arg",
        "seq_len=1024",
        "--dataset",
        "tokens",
        "--data-path",
        data,
        "--batch-size",
        "16",
        "--learning-rate",
        "3e-4",
    ]
    curves = {}
    for precision in ("dtype", "fp8"):
        report = train(os.path.join(args.work, f"loss-{precision}"), precision, model, args.steps)
        curves[precision] = report["losses"]
        r = row("llama-1b", precision, report)
        print(
            f"llama-1b {precision:6s} step {r['step_ms']:.1f} ms, loss {report['losses'][0]:.4f} -> "
            f"{report['losses'][-1]:.4f}, {r['wall_s']} s",
            flush=True,
        )
    tail = {p: statistics.mean(c[-20:]) for p, c in curves.items()}
    gap = tail["fp8"] / tail["dtype"] - 1
    print(f"mean of the last 20 steps: bf16 {tail['dtype']:.4f}, fp8 {tail['fp8']:.4f} ({gap * 100:+.2f} %)", flush=True)
    _plot(curves, os.path.join(args.out, "gpu_fp8_loss.png"))
    return {"curves": curves, "last20": tail, "relative_gap": gap, "model": model}


def _plot(curves, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for precision, c in curves.items():
        ax.plot(range(1, len(c) + 1), c, label="bf16" if precision == "dtype" else "fp8", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("LLaMA ~1B, tokens of real text: bf16 vs fp8")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("speed", "loss"))
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--work", default="/tmp/gpu_fp8")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    args.steps = args.steps or (30 if args.mode == "speed" else 500)
    os.makedirs(args.work, exist_ok=True)
    result = speed(args) if args.mode == "speed" else loss(args)
    print("saved", save_result(f"gpu_fp8-{args.mode}", args.out, result), flush=True)


if __name__ == "__main__":
    main()
