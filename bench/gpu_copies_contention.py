"""What a whole compile in the background does to the step times auto's shallow copies are ranked by.

`--strategy auto` (ranking on copies) compiles its likeliest winner whole on a thread while the
copies run. This builds the three candidates' copies of one depth (the way the search does), then
times them in rotated rounds before, during and after a whole fsdp compile on a thread, and prints
each candidate's step time per phase: how much the compile slows each, and for how long.

    python3 bench/gpu_copies_contention.py --case gpt24 --depth 3
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import time

import lib.checkout  # noqa: F401 - first: alpa_job from this checkout

STEPS_PER_TURN = 5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="gpt24")
    parser.add_argument("--per-gpu-batch", type=int, default=8)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--rounds-after", type=int, default=4)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()

    import jax

    from alpa_job import models
    from alpa_job.engines.jax_engine import JaxEngine
    from gpu_common import engine_loop, gpt_case
    from lib.results import save_result

    n = jax.device_count()
    batch_size = args.per_gpu_batch * n
    config, model, batch = gpt_case(args.case, batch_size=batch_size, num_samples=batch_size)
    copy_config, copy_model = models.at_depth(config, model, args.depth)
    candidates = [("fsdp", (n, 1)), ("data", (n, 1)), ("tensor", (1, n))]
    copies = [(name, JaxEngine(copy_config, copy_model, batch, name, mesh)) for name, mesh in candidates]
    start = time.perf_counter()
    copies[0][1].compile_step()  # autotunes the kernels, as the search's first copy does
    for _, engine in copies[1:]:
        engine.compile_step()
    compiled_s = time.perf_counter() - start
    loops = []
    for name, engine in copies:
        loops.append(engine_loop(engine, 0, batch))
        loops[-1].name = name
    whole = JaxEngine(config, model, batch, "fsdp", (n, 1))

    rows = []
    t0 = time.perf_counter()

    def rounds(phase: str, until=None, count=None):
        done = 0
        while (until is not None and not until()) or (count is not None and done < count):
            for offset in range(len(loops)):
                loop = loops[(done + offset) % len(loops)]
                begin = time.perf_counter()
                seconds = loop.time(STEPS_PER_TURN, parked=False)  # one untimed step first
                rows.append(
                    {
                        "phase": phase,
                        "t_s": round(begin - t0, 3),
                        "candidate": loop.name,
                        "step_ms": round(seconds * 1e3, 3),
                        "load1": os.getloadavg()[0],
                    }
                )
            done += 1

    rounds("before", count=args.rounds_after)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    background = pool.submit(whole.compile)
    bg_start = time.perf_counter() - t0
    rounds("during", until=background.done)
    background.result()
    bg_end = time.perf_counter() - t0
    rounds("after", count=args.rounds_after)

    table = {}
    for phase in ("before", "during", "after"):
        for name, _ in candidates:
            times = [r["step_ms"] for r in rows if r["phase"] == phase and r["candidate"] == name]
            if times:
                table[f"{phase}/{name}"] = {
                    "median_ms": round(statistics.median(times), 3),
                    "min_ms": min(times),
                    "max_ms": max(times),
                    "turns": len(times),
                }
    print(
        f"{n} x {jax.devices()[0].device_kind}, {args.case} copy of {args.depth} layers; copies compiled in "
        f"{compiled_s:.1f} s; whole fsdp compile in the background {bg_start:.1f}-{bg_end:.1f} s"
    )
    print(f"{'phase/candidate':<20} {'median ms':>10} {'min':>8} {'max':>8} {'turns':>6}")
    for key, row in table.items():
        print(f"{key:<20} {row['median_ms']:>10.2f} {row['min_ms']:>8.2f} {row['max_ms']:>8.2f} {row['turns']:>6}")
    print(
        save_result(
            "gpu_copies_contention",
            args.out,
            {
                "case": args.case,
                "depth": args.depth,
                "devices": n,
                "copies_compile_s": round(compiled_s, 3),
                "background_s": [round(bg_start, 3), round(bg_end, 3)],
                "table": table,
                "turns": rows,
            },
        )
    )


if __name__ == "__main__":
    main()
