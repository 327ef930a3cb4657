"""The planner's validation table: each measured run of validation.json that has a kernels block, predicted
by the kernel cost model (the shipped H200 profile, constants fitted to calibration.json) beside what it
measured: step time, peak memory, the dominant term; then, for each model measured with several strategies
on one device count, the predicted winner against the measured one.

Reads only the committed measurements (no GPU): `python -m alpa_job.planner.calibrate` regenerates the
kernels blocks, bench/gpu_planner_validation.py measures the runs.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from alpa_job.planner import estimate, gpus, kernel_estimate  # noqa: E402
from lib.results import record  # noqa: E402
from lib.table import print_table  # noqa: E402


def _gb(value) -> str:
    return f"{value:.2f}" if value else "-"


def main() -> None:
    rates = kernel_estimate.rates_from_profile(gpus.CATALOGUE["h200"].measured)
    constants = kernel_estimate.fit(estimate.load()["entries"], rates)
    checked = kernel_estimate.validation(rates, constants, estimate.load(estimate.VALIDATION_PATH)["entries"])
    rows = [
        [
            r["id"],
            r["model"],
            r["gpus"],
            r["strategy"],
            f"{r['predicted_ms']:.2f}",
            f"{r['measured_ms']:.2f}",
            f"{r['error']:+.1%}",
            r["dominant"],
            _gb(r["predicted_peak_gb"]),
            _gb(r["measured_peak_gb"]),
            f"{r['predicted_peak_gb'] / r['measured_peak_gb'] - 1:+.0%}" if r["predicted_peak_gb"] and r["measured_peak_gb"] else "-",
        ]
        for r in checked["runs"]
    ]
    header = ["run", "model", "GPUs", "strategy", "predicted ms", "measured ms", "error", "mostly", "pred. GB", "meas. GB", "GB error"]
    table = print_table(header, rows)
    summary = f"median |error| {checked['median']:.1%}, worst {checked['worst']:.1%} over {len(rows)} runs"
    print(summary)
    winners = [[w["model"], w["gpus"], w["predicted_winner"], w["measured_winner"], f"{w['slower_by']:+.1%}"] for w in checked["winners"]]
    table += "\n\n" + summary + "\n\n" + print_table(["model", "GPUs", "planner's pick", "measured best", "pick slower by"], winners)
    results = {"constants": constants.to_dict(), "rates_source": "profiles/h200.json (shipped)", **checked}
    record("planner_validation_table", results, table, "The kernel cost model against measured runs it was not fitted on")


if __name__ == "__main__":
    main()
