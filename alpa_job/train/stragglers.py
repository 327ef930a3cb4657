"""Stragglers: which process (host, GPU) is slower than the others, named while the run goes on.

A synchronous step takes as long on every process: its collectives wait for the slowest, so step times
cannot say who is slow. So every `--straggler-every` steps, at the same step on every process, each process
measures its own share, the work that nothing waits on:
- its devices. A GPU: the same fixed probe (a chain of matmuls in the run's dtype) timed on each GPU while it
  is idle. A CPU host, whose devices are its cores: the CPU time its threads used since the last round plus
  the longer of the time they were ready to run but got no CPU (the kernel's schedstat) and the time its
  cgroup's CPU quota held it back (cpu.stat: a container's CPU limit, which schedstat does not always show);
  time blocked waiting for the other processes counts in neither.
- its input: the time its host spent producing and placing its batches.
The processes exchange these numbers in one small all-gather, and every process judges them alike. Over the
last `--straggler-window` steps (WINDOW_STEPS by default), a device is named when its total is SLOWER x the median of the other devices' and
it was that much slower in most of the window's rounds (one noisy round does not name anyone); it is cleared
when it falls under RECOVERED x. A process whose input adds SLOWER - 1 of the step time over the others' is
named the same way.
"""

from __future__ import annotations

import glob
import math
import os
import socket
import time
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from alpa_job.progress.events import metrics, note
from alpa_job.engines import every_process

WINDOW_STEPS = 50  # --straggler-window's default
SLOWER = 1.10
RECOVERED = 1.05
MOST_ROUNDS = 0.75  # the share of a window's rounds that must be slow too
# The GPU probe: long enough that launch jitter does not decide it, short against a step.
GPU_PROBE = {"size": 4096, "matmuls": 8}
HOSTNAME_BYTES = 64


class StragglerJudge:
    """Pure numbers in, verdicts out: the same on every process, as each gets the same gathered rows.

    A round gives, per unit (a process's device), its seconds of own work, and per process its input seconds
    per step. `units[i]` = (process, device label)."""

    def __init__(self, units: Sequence[Tuple[int, str]], hosts: Sequence[str], every: int, window: int = WINDOW_STEPS):
        self.units, self.hosts, self.every, self.window = list(units), list(hosts), every, window
        self.rounds = max(1, math.ceil(window / every))
        self.work: Deque[List[float]] = deque(maxlen=self.rounds)
        self.inputs: Deque[List[float]] = deque(maxlen=self.rounds)
        self.step_s: Deque[float] = deque(maxlen=self.rounds)
        self.slow: Dict[Tuple[str, int], float] = {}  # (what, index) -> its score when last judged
        self.events: List[Dict[str, Any]] = []
        self.latest: Dict[str, Any] = {}

    def add(self, step: int, work_s: Sequence[float], input_s: Sequence[float], step_s: Optional[float]) -> List[Dict[str, Any]]:
        """One round at global `step`; returns the events it caused (named, or recovered)."""
        self.work.append(list(work_s))
        self.inputs.append(list(input_s))
        self.step_s.append(step_s or 0.0)
        if len(self.work) < self.rounds:
            return []
        work = [_scores(list(self.work), i, _work_score) for i in range(len(self.units))]
        inputs = [_scores(list(zip(self.inputs, self.step_s)), p, _input_score) for p in range(len(self.hosts))]
        self.latest = {
            "step": step,
            "work_ms": [round(sum(r[i] for r in self.work) / self.rounds * 1e3, 3) for i in range(len(self.units))],
            "work_ratio": [round(total, 3) for total, _ in work],
            "input_ms": [round(sum(r[p] for r in self.inputs) / self.rounds * 1e3, 3) for p in range(len(self.hosts))],
            "input_ratio": [round(total, 3) for total, _ in inputs],
        }
        events = [self._judge(("devices", i), *work[i], step) for i in range(len(work))]
        events += [self._judge(("input", p), *inputs[p], step) for p in range(len(inputs))]
        new = [e for e in events if e is not None]
        self.events += new
        return new

    def _judge(self, key: Tuple[str, int], total: float, slow_rounds: float, step: int) -> Optional[Dict[str, Any]]:
        named = key in self.slow
        if not named and total >= SLOWER and slow_rounds >= MOST_ROUNDS:
            self.slow[key] = total
            return self._event("slow", key, total, step)
        if named and (total < RECOVERED or slow_rounds < 0.5):
            del self.slow[key]
            return self._event("recovered", key, total, step)
        if named:
            self.slow[key] = total
        return None

    def _event(self, kind: str, key: Tuple[str, int], ratio: float, step: int) -> Dict[str, Any]:
        what, index = key
        process, device = self.units[index] if what == "devices" else (index, "")
        return {
            "event": kind,
            "what": what,
            "step": step,
            "process": process,
            "host": self.hosts[process],
            "device": device,
            "slower_by": round(ratio - 1.0, 3),
            "steps": [max(0, step - self.rounds * self.every) + 1, step],
        }

    def named_now(self) -> List[str]:
        """Who is named as slow now, shortest form (the progress line's)."""
        out = []
        for (what, index), ratio in sorted(self.slow.items()):
            process, device = self.units[index] if what == "devices" else (index, "input")
            out.append(f"process {process} on {self.hosts[process]}{' ' + device if device else ''} +{(ratio - 1) * 100:.0f}%")
        return out


def _scores(rows: List[Any], i: int, score) -> Tuple[float, float]:
    """(the window's score of column i, the share of its rounds that alone score SLOWER)."""
    per_round = [score([row], i) for row in rows]
    return score(rows, i), sum(s >= SLOWER for s in per_round) / len(per_round)


def _work_score(rows: List[List[float]], i: int) -> float:
    # Column i's total over the rows against the median of the other columns' totals.
    totals = [sum(row[j] for row in rows) for j in range(len(rows[0]))]
    others = _median([t for j, t in enumerate(totals) if j != i])
    return totals[i] / others if others > 0 and len(totals) > 1 else 1.0


def _input_score(rows: List[Tuple[List[float], float]], p: int) -> float:
    # 1 + the step time process p's input adds over the others' median, as a share of the step.
    step_s = sum(s for _, s in rows)
    if step_s <= 0:
        return 1.0
    totals = [sum(r[q] for r, _ in rows) for q in range(len(rows[0][0]))]
    others = _median([t for q, t in enumerate(totals) if q != p])
    return 1.0 + max(0.0, totals[p] - others) / step_s if len(totals) > 1 else 1.0


def describe(event: Dict[str, Any]) -> str:
    """The log line for one event."""
    who = f"process {event['process']} (host {event['host']}{', ' + event['device'] if event['device'] else ''})"
    first, last = event["steps"]
    if event["what"] == "input":
        share = f"its input costs each step {event['slower_by'] * 100:.0f} % of the step more than the others'"
    else:
        share = f"its own work takes {event['slower_by'] * 100:.0f} % longer than the others' median"
    if event["event"] == "recovered":
        return f"straggler: {who} is no longer slow ({share.replace('its', 'now')}, steps {first}-{last})"
    return f"straggler: {who}: {share} over steps {first}-{last}"


class StragglerWatch:
    """The loop's side (train/hooks.StragglerHook, every `every` steps): `input_time(s, steps)`, then `__call__(step, step_s)`
    (the devices idle: the loop has waited for its queued steps), which measures, exchanges, judges and
    reports; it returns the seconds it took, which are not a step's."""

    def __init__(self, every: int, dtype: str, window: int = WINDOW_STEPS):
        import jax

        self.every = every
        self.backend = jax.default_backend()
        self._input_s, self._input_steps = 0.0, 0
        self._own: Any = GpuProbe(jax.local_devices(), dtype) if self.backend == "gpu" else ThreadTime(every)
        # Its first all-gather sets up a new group of the CPU collectives, whose rendezvous allows 30 s: every
        # process gets here first (one still compiling its probe on a busy host would miss it).
        every_process.wait("alpa_job_stragglers")
        hosts = _gather_hostnames()
        labels = self._own.labels
        self.judge = StragglerJudge([(p, label) for p in range(len(hosts)) for label in labels], hosts, every, window)

    @classmethod
    def for_run(cls, config, engine, process_count: int) -> Optional["StragglerWatch"]:
        every = getattr(config, "straggler_every", 0)
        if process_count <= 1 or not every or engine.name != "jax":
            return None
        from jax.experimental import multihost_utils

        if not hasattr(multihost_utils, "process_allgather"):  # an older jax: the run goes on without the watch
            note("[alpa_job] stragglers: this jax has no process_allgather; the watch is off")
            return None
        return cls(every, config.dtype, getattr(config, "straggler_window", WINDOW_STEPS))

    def input_time(self, seconds: float, steps: int) -> None:
        """This process's input time over the `steps` since the last round."""
        self._input_s, self._input_steps = seconds, steps

    def __call__(self, step: int, step_s: Optional[float]) -> float:
        from jax.experimental import multihost_utils
        import numpy as np

        started = time.perf_counter()
        work = self._own.measure()
        own = work + [self._input_s / max(1, self._input_steps)]
        self._input_s, self._input_steps = 0.0, 0
        rows = np.asarray(multihost_utils.process_allgather(np.asarray(own, np.float64)))
        width = len(work)
        events = self.judge.add(step, rows[:, :width].reshape(-1).tolist(), rows[:, width].tolist(), step_s)
        for event in events:
            note(f"[alpa_job] {describe(event)}")
        self._metrics(step)
        return time.perf_counter() - started

    def _metrics(self, step: int) -> None:
        latest = self.judge.latest
        if not latest:
            return
        scalars = {"stragglers/slowest_ratio": max(latest["work_ratio"])}
        for (process, device), ms in zip(self.judge.units, latest["work_ms"]):
            scalars[f"stragglers/work_ms/process{process}{device.replace('GPU ', '_gpu')}"] = ms
        for process, ms in enumerate(latest["input_ms"]):
            scalars[f"stragglers/input_ms/process{process}"] = ms
        metrics(step, scalars)

    def alert(self) -> Optional[str]:
        named = self.judge.named_now()
        return "slow: " + ", ".join(named) if named else None

    def summary(self) -> Dict[str, Any]:
        """The report's `stragglers`."""
        j = self.judge
        return {
            "every": self.every,
            "window_steps": j.window,
            "slower": SLOWER,
            "recovered": RECOVERED,
            "measure": self._own.describe(),
            "units": [{"process": p, "host": j.hosts[p], "device": d} for p, d in j.units],
            "latest": j.latest or None,
            "events": j.events,
            "slow_now": j.named_now(),
        }


class GpuProbe:
    """A GPU's own work: the same matmul chain, compiled once, timed on each local GPU in turn."""

    def __init__(self, devices: List[Any], dtype: str):
        import jax
        import jax.numpy as jnp
        import numpy as np

        size, matmuls = GPU_PROBE["size"], GPU_PROBE["matmuls"]
        self.labels = [f"GPU {i}" for i in range(len(devices))]
        self.dtype = dtype

        def chain(x):
            y = x
            for _ in range(matmuls):
                y = jnp.tanh(y @ x)  # tanh: the values stay bounded, whatever the chain's length
            return y

        self.fn = jax.jit(chain)
        start = np.random.default_rng(0).standard_normal((size, size)).astype(np.float32) / math.sqrt(size)
        kind = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
        self.inputs = [jax.device_put(jnp.asarray(start, kind), d) for d in devices]
        for x in self.inputs:
            self.fn(x).block_until_ready()  # compiled (and warm) before the first timed round

    def measure(self) -> List[float]:
        out = []
        for x in self.inputs:
            started = time.perf_counter()
            self.fn(x).block_until_ready()
            out.append(time.perf_counter() - started)
        return out

    def describe(self) -> Dict[str, Any]:
        return {"kind": "gpu probe", **GPU_PROBE, "dtype": self.dtype}


class ThreadTime:
    """A CPU host's own work a step since the last round (`every` steps ago): its threads' CPU time plus the
    longer of their wait for a CPU (Linux's /proc/self/task/*/schedstat; a thread that exited takes its last
    counts with it) and the time its cgroup's CPU quota throttled it (cpu.stat; 0 where no quota or no
    cgroupfs). The kernel counts a throttled thread's time as its wait in some cases and not in others: the
    longer of the two sees the quota either way, without counting it twice."""

    labels = [""]

    def __init__(self, every: int, cgroup_root: str = "/sys/fs/cgroup"):
        self.every = every
        self._cpu_stat = cgroup_cpu_stat(cgroup_root)
        self._last = _schedstat()
        self._last_throttled = _throttled_ns(self._cpu_stat)

    def measure(self) -> List[float]:
        now, throttled = _schedstat(), _throttled_ns(self._cpu_stat)
        on_cpu = waiting = 0
        for tid, (cpu, wait) in now.items():
            cpu0, wait0 = self._last.get(tid, (0, 0))
            if cpu >= cpu0 and wait >= wait0:  # a reused thread id starts from 0 again: its counts since then
                on_cpu, waiting = on_cpu + cpu - cpu0, waiting + wait - wait0
        held_back = max(waiting, throttled - self._last_throttled)
        self._last, self._last_throttled = now, throttled
        return [(on_cpu + held_back) / 1e9 / self.every]

    @staticmethod
    def describe() -> Dict[str, Any]:
        return {"kind": "cpu time + run-queue wait or quota throttling"}


def _schedstat() -> Dict[str, Tuple[int, int]]:
    """Per thread of this process: (nanoseconds on a CPU, nanoseconds ready but waiting for one)."""
    out = {}
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path) as f:
                on_cpu, waiting = f.read().split()[:2]
            out[path.split("/")[4]] = (int(on_cpu), int(waiting))
        except (OSError, ValueError):
            continue  # the thread ended between the listing and the read
    return out


def cgroup_cpu_stat(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> Optional[str]:
    """The cpu.stat file of this process's CPU cgroup (v2's unified one, or v1's `cpu` hierarchy), or None
    where it cannot be read (no cgroupfs mounted, as in a network namespace's own sysfs)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):  # v1: mounted under its controllers' names (a `cpu` link beside)
            candidates += [os.path.join(root, name) + path for name in dict.fromkeys((controllers, "cpu"))]
        elif controllers == "":  # v2
            candidates.append(root + path)
    for directory in candidates:
        stat = os.path.join(directory, "cpu.stat")
        if os.path.exists(stat):
            return stat
    return None


def _throttled_ns(cpu_stat: Optional[str]) -> int:
    """The cgroup's total throttled time so far: v1's throttled_time (ns) or v2's throttled_usec; 0 without one."""
    if cpu_stat is None:
        return 0
    try:
        with open(cpu_stat) as f:
            fields = dict(line.split()[:2] for line in f if line.strip())
    except (OSError, ValueError):
        return 0
    if "throttled_time" in fields:
        return int(fields["throttled_time"])
    return int(fields.get("throttled_usec", 0)) * 1000


def _gather_hostnames() -> List[str]:
    from jax.experimental import multihost_utils
    import numpy as np

    own = socket.gethostname().encode()[:HOSTNAME_BYTES].ljust(HOSTNAME_BYTES, b"\0")
    rows = np.asarray(multihost_utils.process_allgather(np.frombuffer(own, np.uint8)))
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows.reshape(-1, HOSTNAME_BYTES)]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
