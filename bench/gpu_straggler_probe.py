"""What the straggler watch's GPU probe costs a training run, and how steady it is round to round.

On one GPU, the kit's JaxEngine trains a GPT case in blocks of steps, alternating two loops over the same
state: plain steps, and the same steps with the watch's rhythm (every EVERY steps: wait for the queued steps,
then time GpuProbe on the idle GPU). The table gives each loop's median step time, the probe's time and its
spread between rounds, and the spread of a 50-step window's median: the noise the watch's 10 % line has to
stand clear of.

    python3 bench/gpu_straggler_probe.py --case gpt12 --blocks 6 --block-steps 100
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import lib.checkout  # noqa: F401 - first: alpa_job from this checkout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="gpt12")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--block-steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()

    import jax

    from gpu_common import gpt_case
    from lib.results import save_result
    from alpa_job.engines.jax_engine import JaxEngine
    from alpa_job.train.stragglers import GPU_PROBE, WINDOW_STEPS, GpuProbe

    config, model, batch = gpt_case(args.case)
    engine = JaxEngine(config, model, batch, "data", (1, 1))
    engine.compile()
    state = engine.init_state(0)
    placed = engine.put_batch(batch)
    probe = GpuProbe(jax.local_devices(), config.dtype)
    for _ in range(3):  # warm
        state, loss = engine.step(state, placed)
    jax.block_until_ready(loss)

    step_s = {"plain": [], "probe": []}
    rounds = []
    for block in range(args.blocks):
        for kind in ("plain", "probe") if block % 2 == 0 else ("probe", "plain"):
            started, spent = time.perf_counter(), 0.0
            for i in range(1, args.block_steps + 1):
                state, loss = engine.step(state, placed)
                if kind == "probe" and i % args.every == 0:
                    jax.block_until_ready(loss)  # the watch's wait for the queued steps
                    probe_started = time.perf_counter()
                    rounds.append(probe.measure()[0])
                    spent += time.perf_counter() - probe_started
            jax.block_until_ready(loss)
            # The wall time a step took with the watch's rhythm (its wait and probe included)
            step_s[kind].append((time.perf_counter() - started) / args.block_steps)
    per_window = max(1, math.ceil(WINDOW_STEPS / args.every))
    windows = [statistics.median(rounds[i : i + per_window]) for i in range(0, len(rounds) - per_window + 1)]
    median_probe = statistics.median(rounds)
    log_steps = [abs(math.log(b / a)) for a, b in zip(rounds, rounds[1:])]
    result = {
        "case": args.case,
        "every": args.every,
        "probe": GPU_PROBE,
        "dtype": config.dtype,
        "step_ms_plain": round(statistics.median(step_s["plain"]) * 1e3, 3),
        "step_ms_with_watch": round(statistics.median(step_s["probe"]) * 1e3, 3),
        "probe_ms_median": round(median_probe * 1e3, 4),
        "probe_ms_p10_p90": [
            round(sorted(rounds)[int(0.1 * len(rounds))] * 1e3, 4),
            round(sorted(rounds)[int(0.9 * len(rounds))] * 1e3, 4),
        ],
        "round_to_round_change_median": round(statistics.median(log_steps), 4),
        "window_median_spread": [round(min(windows) / median_probe, 4), round(max(windows) / median_probe, 4)],
        "rounds": len(rounds),
    }
    result["overhead"] = round(result["step_ms_with_watch"] / result["step_ms_plain"] - 1, 4)
    print(f"{'case':8} {'step ms':>9} {'+watch':>9} {'overhead':>9} {'probe ms':>9} {'p10-p90':>15} {'50-step window / median':>24}")
    print(
        f"{args.case:8} {result['step_ms_plain']:9.2f} {result['step_ms_with_watch']:9.2f} "
        f"{result['overhead'] * 100:8.2f}% {result['probe_ms_median']:9.3f} "
        f"{result['probe_ms_p10_p90'][0]:7.3f}-{result['probe_ms_p10_p90'][1]:<7.3f} "
        f"{result['window_median_spread'][0]:11.4f}-{result['window_median_spread'][1]:.4f}"
    )
    print("saved", save_result("gpu_straggler_probe", args.out, result))


if __name__ == "__main__":
    main()
