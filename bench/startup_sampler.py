"""Where a process's start-up goes, sampled: runs `python -m alpa_job ARGS` in this process while a thread
records every thread's Python stack every few milliseconds, then writes the samples to a JSON file.

    python3 bench/startup_sampler.py SAMPLES.json [--every-ms 5] -- train --preset gpt-24l ...

A statistical profiler (no tracing hooks): the run's own timing is barely touched (one stack walk per
interval, under the GIL), and time spent in C (XLA's loading, a CUDA call) shows as the Python frame
that called it. `summarise(path, until_s)` reads the file back: per thread, consecutive samples with the
same label merged into segments, the label being the innermost kit frame and the innermost frame below it.
Times are seconds since the process started (its age, as the report's process_to_first_step counts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any, Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _process_age() -> float:
    """Seconds since this process started (as alpa_job.train.timing.process_age_s, without importing the kit)."""
    with open("/proc/self/stat") as f:
        start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


class Sampler:
    """Every `every_s`: each thread's stack as indices into a table of 'file:function' frames."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.frames: Dict[str, int] = {}
        self.stacks: Dict[tuple, int] = {}
        self.samples: List[list] = []  # [t, {thread name: stack index}]
        self.origin = time.perf_counter() - _process_age()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="startup-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _frame(self, frame) -> int:
        code = frame.f_code
        path = code.co_filename
        short = os.path.relpath(path, REPO) if path.startswith(REPO) else "/".join(path.split("/")[-2:])
        label = f"{short}:{code.co_name}"
        return self.frames.setdefault(label, len(self.frames))

    def _stack(self, frame) -> int:
        chain = []
        while frame is not None:
            chain.append(self._frame(frame))
            frame = frame.f_back
        key = tuple(reversed(chain))
        return self.stacks.setdefault(key, len(self.stacks))

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.every_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            now = time.perf_counter() - self.origin
            row = {names.get(ident, str(ident)): self._stack(frame) for ident, frame in sys._current_frames().items() if ident != me}
            self.samples.append([round(now, 4), row])

    def dump(self, path: str) -> None:
        frames = [None] * len(self.frames)
        for label, index in self.frames.items():
            frames[index] = label
        stacks = [None] * len(self.stacks)
        for key, index in self.stacks.items():
            stacks[index] = list(key)
        with open(path, "w") as f:
            json.dump({"every_s": self.every_s, "frames": frames, "stacks": stacks, "samples": self.samples}, f)


IDLE = ("threading.py:wait", "selectors.py:select", "futures/thread.py:_worker", "queue.py:get")


def _label(frames: List[str], stack: List[int]) -> str:
    """The innermost frame of the kit (alpa_job/) and, where it called out, the innermost frame below it
    (for an import: the first module it imports)."""
    names = [frames[i] for i in stack]
    kit = [i for i, name in enumerate(names) if name.startswith("alpa_job/")]
    inner = kit[-1] if kit else -1
    below = names[inner + 1 :]
    modules = [n for n in below if n.endswith(":<module>") and not n.startswith("alpa_job/")]
    if any("importlib" in n for n in below) and modules:
        return (names[inner] + " > " if kit else "") + "import " + modules[0].rsplit(":", 1)[0]
    if not kit:
        return names[-1] if names else "?"
    return names[inner] + (f" > {below[-1]}" if below else "")


def summarise(path: str, until_s: float, min_s: float = 0.05) -> Dict[str, Any]:
    """Up to `until_s`: {"segments": {thread: [runs of samples with one label, idle ones left out, those
    shorter than `min_s` folded into the one before]}, "inclusive": {kit function: seconds any thread had
    it on its stack, first and last seen}}."""
    with open(path) as f:
        data = json.load(f)
    frames, stacks = data["frames"], data["stacks"]
    segments: Dict[str, List[Dict[str, Any]]] = {}
    inclusive: Dict[str, Dict[str, float]] = {}
    previous = 0.0
    for t, row in data["samples"]:
        if t > until_s:
            break
        step, previous = t - previous, t
        for thread, stack in row.items():
            label = _label(frames, stacks[stack])
            if any(label.endswith(idle) for idle in IDLE):
                continue
            runs = segments.setdefault(thread, [])
            if runs and runs[-1]["label"] == label:
                runs[-1]["end"] = t
            else:
                runs.append({"label": label, "start": round(t - step, 4), "end": t})
            for name in {frames[i] for i in stacks[stack] if frames[i].startswith("alpa_job/")}:
                seen = inclusive.setdefault(f"{thread}: {name}", {"seconds": 0.0, "first": t, "last": t})
                seen["seconds"] += step
                seen["last"] = t
    for thread, runs in segments.items():
        kept: List[Dict[str, Any]] = []
        for run in runs:
            if kept and run["end"] - run["start"] < min_s:
                kept[-1]["end"] = run["end"]
            else:
                kept.append(run)
        segments[thread] = [{**r, "seconds": round(r["end"] - r["start"], 3)} for r in kept]
    ordered = sorted(inclusive.items(), key=lambda kv: kv[1]["first"])
    return {
        "segments": segments,
        "inclusive": {k: {n: round(v, 3) for n, v in seen.items()} for k, seen in ordered if seen["seconds"] >= min_s},
    }


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("samples")
    parser.add_argument("--every-ms", type=float, default=5.0)
    args = parser.parse_args(argv[:split])
    sampler = Sampler(args.every_ms / 1e3)
    sampler.start()
    import lib.checkout  # noqa: F401 - alpa_job from this checkout
    from alpa_job.cli import main as kit_main

    try:
        code = kit_main(argv[split + 1 :])
    finally:
        sampler.stop()
        sampler.dump(args.samples)
    os._exit(code or 0)  # the run's report is written; its threads need no orderly exit here


if __name__ == "__main__":
    main()
