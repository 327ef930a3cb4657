"""The progress line tells the truth through Ray: the samples/s and ETA process 0's actor sends to the driver
are the steady state the report gives (samples per step over the median timed window), measured where the
steps run. A run with an eval every few steps is the case that used to read low: samples over the wall time
since the loop began counted every eval (and the first step) as training."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent


def _tokens(path: Path, n: int, vocab: int = 64) -> str:
    (np.arange(n) * 5 % vocab).astype(np.uint16).tofile(path)
    return str(path)


def test_progress_rate_through_ray_is_the_reports_steady_rate(tmp_path):
    train, held = _tokens(tmp_path / "train.bin", 40000), _tokens(tmp_path / "eval.bin", 8000)
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "alpa_job",
            "train",
            "--address",
            "local",
            "--model",
            "gpt",
            "--num-layers",
            "1",
            "--d-model",
            "32",
            "--seq-len",
            "16",
            "--vocab-size",
            "64",
            "--batch-size",
            "16",
            "--dataset",
            "tokens",
            "--data-path",
            train,
            "--eval-data-path",
            held,
            "--eval-every",
            "5",
            "--eval-batches",
            "20",
            "--steps",
            "60",
            "--progress-every",
            "10",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in dict(os.environ, PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0").items() if k != "RAY_ADDRESS"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "joined local Ray" in proc.stderr  # process 0 trained in a Ray actor: its events crossed to the driver
    report = json.loads((out / "report.json").read_text())
    steady = report["timing"]["steady_step"]
    assert steady["samples_per_s"] == pytest.approx(report["samples_seen"] / report["steps"] / steady["median_s"], rel=1e-3)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("[train] step")]
    assert len(lines) == 6 and lines[-1].startswith("[train] step 60/60  loss ") and lines[-1].endswith("ETA 0 s")
    shown = float(re.search(r"  ([\d,]+) samples/s", lines[-1]).group(1).replace(",", ""))
    assert shown == pytest.approx(steady["samples_per_s"], rel=0.05), (lines[-1], steady, report["throughput"])
    # the ETA halfway is the steps left at the steady step time, not at the wall time per step so far
    half = [line for line in lines if line.startswith("[train] step 30/60")][0]
    eta = float(re.search(r"ETA (\d+) s", half).group(1))
    assert eta <= round(30 * steady["p90_s"] * 1.5) + 1, (half, steady)
