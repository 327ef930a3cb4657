"""The multi-host path on one machine: two Ray nodes on distinct loopback addresses, one JAX process each.

Node A is the head (`ray start --head --node-ip-address 127.0.0.1`: Ray replaces a loopback head address
with the machine's own interface address, so the node list, not the flag, says which IP it has), node B
joins it as 127.0.0.2. On GPUs each node sees one card (CUDA_VISIBLE_DEVICES=0 / =1, --num-gpus 1) and
NCCL is held to sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo),
so the two processes talk like two hosts; with --gpus-per-node G each node sees G cards and is a host of
its own to NCCL (NCCL_HOSTID): NVLink within a node, sockets across; with --cpu each node's process emulates --devices CPU devices.
Then, through the kit's one-process-per-node path (`python -m alpa_job train --address 127.0.0.1:PORT`):

  data, fsdp   a short run each: report.json must say 2 processes on 2 hosts and the losses must fall;
               step ms, MFU, and the last progress line's samples/s beside the report's steady-state rate
  kill         a long run; once it has done --kill-after steps, SIGKILL node B's JAX process (the
               JaxProcess actor's worker, found by the node's marker in its environment) and time the
               driver's line naming the lost process (target: within 15 s) and its exit

Every wait is bounded (--timeout per phase, --deadline for the whole script); the nodes are always
stopped at the end, by the process ids that carry this run's marker (never `ray stop`, which would end
every Ray on the machine). Without Ray installed (the GPU machines), `--whl DIR` (make-ray-slim's output:
ray-slim.tar.xz and the jsonschema wheels) is unpacked into a temporary site folder first.

    python3 bench/gpu_two_nodes.py --whl .whl                      # 2 GPUs: GPT 12L, data + fsdp + kill
    .venv/bin/python bench/gpu_two_nodes.py --cpu --out /tmp/tw    # the same path on CPU devices

Prints one table and saves OUT/gpu_two_nodes-<UTC time>.json (OUT: --out, else $OUT, else bench/results)
with the commands, the nodes, each run's report numbers and the tail of its driver output.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Dict, List, Optional, Sequence, Tuple

from lib import results

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG_VAR = "GPU_TWO_NODES_TAG"  # every process a node starts inherits it: how they are found and stopped
NODE_B_IP = "127.0.0.2"
NCCL_OVER_SOCKETS = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_NVLS_ENABLE": "0",
}
# Nodes of several GPUs: each node a host of its own to NCCL (its own NCCL_HOSTID), so its GPUs talk over
# NVLink (P2P) within it and over sockets to the other node's, as two hosts without InfiniBand would.
TWO_HOSTS = {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo", "NCCL_NVLS_ENABLE": "0"}
# NCCL's own account of each channel's transport ("via NET/Socket/0") lands in the workers' logs: the
# evidence that the two processes talked through sockets.
NCCL_DEBUG = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
MAX_NCCL_LINES = 20000
TRANSPORT = re.compile(r"via (NET/\S+|P2P\S*|SHM\S*|CollNet\S*)")
NAMED_WITHIN_S = 15.0
STEP_LINE = re.compile(r"\[train\] step (\d+)/")
PLACED = re.compile(r"\[alpa_job\] (\d+) JAX process\(es\) on ([^;]+);")
RATE = re.compile(r"([\d,]+(?:\.\d+)?) samples/s")
# The driver's lines that name a lost process (controller: "lost JAX process 1 on host ..."; the exit's
# error line names it too).
LOST_LINE = re.compile(r"lost JAX process|error: .*process \d+ on host")


class Failed(Exception):
    """A phase that did not do what it must: one line, the script exits non-zero."""


def log(msg: str) -> None:
    print(f"[two-nodes {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Deadline:
    def __init__(self, total_s: float, phase_s: float):
        self.end = time.monotonic() + total_s
        self.phase_s = phase_s

    def left(self) -> float:
        return self.end - time.monotonic()

    def phase(self) -> float:
        """Seconds the next phase may take: its own limit, or what is left of the whole script."""
        left = self.left()
        if left < 5:
            raise Failed("the global deadline is spent; raise --deadline")
        return min(self.phase_s, left)


# ---- Ray where it is not installed ----------------------------------------------------------------
def ensure_ray(whl: Optional[str], env: Dict[str, str]) -> Optional[str]:
    """Nothing when `import ray` works; else make-ray-slim's bundle unpacked into a temp site folder, put
    on PYTHONPATH / PATH of every subprocess (`env`). Returns that folder."""
    if importlib.util.find_spec("ray") is not None:
        return None
    if not whl:
        raise Failed("Ray is not installed here; pass --whl DIR with make-ray-slim's ray-slim.tar.xz and wheels")
    bundle = os.path.join(whl, "ray-slim.tar.xz")
    wheels = sorted(glob.glob(os.path.join(whl, "*.whl")))
    if not os.path.isfile(bundle):
        raise Failed(f"{bundle} not found; build it with make-ray-slim OUTDIR and pass --whl OUTDIR")
    site = tempfile.mkdtemp(prefix="ray-site-")
    start = time.monotonic()
    try:
        subprocess.run(["tar", "-xJf", bundle, "-C", site], check=True, timeout=300)
    except (OSError, subprocess.CalledProcessError):  # no tar or no xz: Python reads xz itself
        import tarfile

        with tarfile.open(bundle, "r:xz") as tar:
            tar.extractall(site, filter="tar") if sys.version_info >= (3, 12) else tar.extractall(site)
    if wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site, *wheels], check=True, timeout=300
        )
    env["PYTHONPATH"] = os.pathsep.join([site, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([os.path.join(site, "bin"), env.get("PATH", "")])
    check = subprocess.run(
        [sys.executable, "-c", "import ray; print(ray.__version__)"], env=env, capture_output=True, text=True, timeout=120
    )
    if check.returncode != 0:
        raise Failed(f"Ray unpacked into {site} does not import: {check.stderr.strip().splitlines()[-1:]}")
    log(f"Ray {check.stdout.strip()} unpacked into {site} in {time.monotonic() - start:.1f} s")
    return site


def base_env(args) -> Dict[str, str]:
    env = dict(os.environ)
    # A caller's Ray variables must not leak in: an address, or a token that turns auth on for one side
    # only (Ray enables token auth by itself when ~/.ray/auth_token exists and the mode is unset).
    for k in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(k, None)
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [REPO, env.get("PYTHONPATH", "")] if p)
    return env


# ---- the processes a node started -----------------------------------------------------------------
def tagged_pids(tag_prefix: str) -> Dict[int, str]:
    """{pid: tag} of every process whose environment carries TAG_VAR starting with `tag_prefix`."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(TAG_VAR.encode() + b"="):
                value = item.split(b"=", 1)[1].decode(errors="replace")
                if value.startswith(tag_prefix):
                    found[int(entry)] = value
                break
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def stop_tagged(tag_prefix: str, grace_s: float = 5.0) -> int:
    """SIGTERM, then SIGKILL after `grace_s`, every process of this run's nodes; how many there were."""
    pids = [p for p in tagged_pids(tag_prefix) if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace_s
        while time.monotonic() < end and any(os.path.exists(f"/proc/{p}") and _alive(p) for p in pids):
            time.sleep(0.2)
    return len(pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---- the two nodes ------------------------------------------------------------------------------------
class Cluster:
    def __init__(self, args, env: Dict[str, str], workdir: str, sockets: bool):
        self.args, self.env, self.workdir = args, env, workdir
        self.sockets = sockets  # NCCL held to sockets (GPU mode), else NCCL's own choice of transports
        self.tag = "tw2n-" + uuid.uuid4().hex[:8]
        self.port = args.port
        self.address = f"127.0.0.1:{self.port}"
        self.commands: List[str] = []
        self.nodes: List[dict] = []
        self.head_ip: Optional[str] = None

    def ray(self, *argv: str) -> List[str]:
        return [sys.executable, "-m", "ray.scripts.scripts", *argv]

    def node_env(self, which: str) -> Dict[str, str]:
        env = dict(self.env, **{TAG_VAR: f"{self.tag}-{which}"})
        if not self.args.cpu:
            per_node = self.args.gpus_per_node
            first = 0 if which == "a" else per_node
            env.update(NCCL_DEBUG, CUDA_VISIBLE_DEVICES=",".join(str(first + i) for i in range(per_node)), NCCL_NVLS_ENABLE="0")
            if self.sockets:
                env.update(NCCL_OVER_SOCKETS if per_node == 1 else dict(TWO_HOSTS, NCCL_HOSTID=f"{self.tag}-{which}"))
        return env

    def start(self, deadline: Deadline) -> None:
        per_node = ["--num-cpus", str(self.args.num_cpus), "--disable-usage-stats"]
        if not self.args.cpu:
            per_node += ["--num-gpus", str(self.args.gpus_per_node)]
        head = self.ray(
            "start",
            "--head",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--temp-dir",
            os.path.join(self.workdir, "ray-a"),
            "--include-dashboard=false",
            *per_node,
        )
        # The dashboard agent's listen port is fixed by default (52365): the second node on this machine
        # takes the next one.
        worker = self.ray(
            "start",
            "--address",
            self.address,
            "--node-ip-address",
            NODE_B_IP,
            "--temp-dir",
            os.path.join(self.workdir, "ray-b"),
            "--dashboard-agent-listen-port",
            str(self.args.agent_port),
            *per_node,
        )
        for which, argv in (("a", head), ("b", worker)):
            env = self.node_env(which)
            shown = {k: env[k] for k in ("CUDA_VISIBLE_DEVICES", *NCCL_OVER_SOCKETS, "NCCL_HOSTID") if k in env}
            self.commands.append(" ".join([*(f"{k}={v}" for k, v in shown.items()), "ray", *map(shlex.quote, argv[3:])]))
            log(f"node {which.upper()}: {self.commands[-1]}")
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=deadline.phase())
            if proc.returncode != 0:
                raise Failed(
                    f"ray start (node {which.upper()}) exited {proc.returncode}: "
                    + " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
                )
        self.wait_nodes(deadline)

    def node_list(self, timeout_s: float) -> List[dict]:
        code = (
            "import json, ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
            "print('NODES', json.dumps([{'ip': n['NodeManagerAddress'], 'alive': n['Alive'], "
            "'id': n['NodeID'], 'resources': n.get('Resources', {})} for n in ray.nodes()]))" % self.address
        )
        proc = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=timeout_s)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("NODES ")]
        if proc.returncode != 0 or not line:
            raise Failed("reading Ray's node list failed: " + " | ".join(proc.stderr.strip().splitlines()[-3:]))
        return json.loads(line[0][len("NODES ") :])

    def wait_nodes(self, deadline: Deadline) -> None:
        """Until Ray lists 2 alive nodes, B at 127.0.0.2; the head's IP is the other one's (as Ray reports it)."""
        end = time.monotonic() + deadline.phase()
        nodes: List[dict] = []
        while time.monotonic() < end:
            try:
                nodes = [n for n in self.node_list(max(5.0, end - time.monotonic())) if n["alive"]]
            except (Failed, subprocess.TimeoutExpired) as err:
                log(f"node list not yet: {err}")
                nodes = []
            if len(nodes) == 2 and any(n["ip"] == NODE_B_IP for n in nodes):
                break
            time.sleep(1.0)
        else:
            raise Failed(f"Ray did not list 2 alive nodes (one at {NODE_B_IP}) in time: {nodes}")
        self.nodes = nodes
        self.head_ip = next(n["ip"] for n in nodes if n["ip"] != NODE_B_IP)
        gpus = [n["resources"].get("GPU", 0) for n in nodes]
        log(f"Ray lists 2 nodes: head {self.head_ip} (asked 127.0.0.1), {NODE_B_IP}; GPUs per node {gpus}")
        if not self.args.cpu and gpus != [self.args.gpus_per_node] * 2:
            raise Failed(f"each node should have {self.args.gpus_per_node} GPU(s), Ray lists {gpus}")

    def stop(self) -> int:
        """Both nodes' processes ended; returns how many are still alive (0 expected)."""
        n = stop_tagged(self.tag)
        left = [p for p in tagged_pids(self.tag) if _alive(p)]
        log(f"stopped {n} processes of both nodes (marker {self.tag})" + (f"; STILL ALIVE: {left}" if left else ""))
        return len(left)

    def node_b_process(self) -> Optional[int]:
        """The pid of the JAX process on node B: its JaxProcess actor's worker."""
        for pid, tag in tagged_pids(self.tag + "-b").items():
            if "JaxProcess" in cmdline(pid):
                return pid
        return None

    def nccl_transports(self) -> Dict[str, object]:
        """How NCCL connected the processes, from the workers' logs of both nodes: each transport's count."""
        counts: Dict[str, int] = {}
        sample: List[str] = []
        lines: List[str] = []  # NCCL's INIT/NET lines as they are, for the doctor's tests on real logs
        for path in glob.glob(os.path.join(self.workdir, "ray-*", "session_latest", "logs", "**", "worker-*"), recursive=True):
            try:
                with open(path, errors="replace") as f:
                    for line in f:
                        if "NCCL INFO" in line and len(lines) < MAX_NCCL_LINES:
                            lines.append(line.rstrip("\n"))
                        m = TRANSPORT.search(line) if "NCCL INFO" in line else None
                        if m:
                            kind = m.group(1).split("/")[0] + ("/" + m.group(1).split("/")[1] if m.group(1).startswith("NET/") else "")
                            counts[kind] = counts.get(kind, 0) + 1
                            if len(sample) < 4:
                                sample.append(line.strip())
            except OSError:
                continue
        return {"channels_by_transport": counts, "sample": sample, "lines": lines}


# ---- one training run ---------------------------------------------------------------------------------
class Driver:
    """`python -m alpa_job train ...` in its own session; every output line kept with its arrival time."""

    def __init__(self, argv: List[str], env: Dict[str, str]):
        self.argv = argv
        self.lines: List[tuple] = []  # (monotonic time, text)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait(self, timeout_s: float) -> Optional[int]:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        self._reader.join(5)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def last_step(self) -> int:
        for _, text in reversed(self.lines):
            m = STEP_LINE.search(text)
            if m:
                return int(m.group(1))
        return 0

    def tail(self, n: int = 40) -> List[str]:
        return [t for _, t in self.lines[-n:]]


def model_args(args, steps: int) -> List[str]:
    if args.cpu:
        batch, samples = 8, 64
        size = [
            "--model",
            "gpt",
            "--num-layers",
            "2",
            "--d-model",
            "64",
            "--num-heads",
            "4",
            "--seq-len",
            "64",
            "--vocab-size",
            "256",
            "--devices",
            str(args.devices),
            "--batch-size",
            str(batch),
        ]
    else:
        batch, samples = args.batch_size or 16, 256  # default the preset's batch
        size = ["--preset", args.preset] + (["--batch-size", str(args.batch_size)] if args.batch_size else [])
    epochs = -(-steps * batch // samples) + 1  # --steps is capped by the epochs: never let them stop it first
    return size + ["--num-samples", str(samples), "--epochs", str(epochs)]


def run_spec(spec: str) -> Tuple[str, str, List[str]]:
    """--strategies entry: STRATEGY, or NAME=STRATEGY+FLAG,VALUE,... (a variant with its own train flags)."""
    name, _, rest = spec.partition("=") if "=" in spec else (spec, "", spec)
    strategy, _, extra = rest.partition("+")
    return name, strategy, [x for x in extra.split(",") if x]


def train_argv(args, cluster: Cluster, strategy: str, steps: int, out: str, extra: Sequence[str] = ()) -> List[str]:
    return [
        sys.executable,
        "-m",
        "alpa_job",
        "train",
        "--address",
        cluster.address,
        *model_args(args, steps),
        "--strategy",
        strategy,
        "--steps",
        str(steps),
        "--out",
        out,
        "--progress-every",
        str(args.progress_every),
        "--max-restarts",
        "0",
        *(shlex.split(args.pipeline_args) if strategy.startswith("pipeline") else []),
        *extra,
    ]


def one_gpu_run(args, scratch: str, deadline: Deadline) -> dict:
    """The same model on one GPU alone, no Ray (--address none): what scaling efficiency divides by."""
    out = os.path.join(scratch, "run-one-gpu")
    argv = [
        sys.executable,
        "-m",
        "alpa_job",
        "train",
        "--address",
        "none",
        "--preset",
        args.preset,
        "--batch-size",
        str(args.one_gpu_batch),
        "--steps",
        str(args.steps),
        "--out",
        out,
        "--quiet",
    ]
    log(f"one GPU: {shown(argv)}")
    env = dict(base_env(args), CUDA_VISIBLE_DEVICES="0")
    started = time.monotonic()
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=deadline.phase())
    except subprocess.TimeoutExpired:
        return {"run": "one GPU", "strategy": "data", "error": "timed out"}
    row = {
        "run": "one GPU",
        "strategy": "data",
        "command": shown(argv),
        "rc": p.returncode,
        "nccl": "-",
        "wall_s": round(time.monotonic() - started, 1),
        "driver_tail": (p.stdout + p.stderr).splitlines()[-20:],
    }
    if p.returncode != 0:
        row["error"] = f"exit {p.returncode}"
        return row
    report = read_report(out)
    steady = (report.get("timing") or {}).get("steady_step") or {}
    row.update(
        processes=1,
        hosts=1,
        step_ms=round(steady["median_s"] * 1e3, 2) if steady.get("median_s") else None,
        samples_per_s_report=steady.get("samples_per_s"),
        mfu=(report.get("timing") or {}).get("mfu"),
        device=(report.get("devices") or {}).get("kind"),
    )
    return row


def add_efficiency(rows: List[dict], gpus: int) -> None:
    """Two-node rows: samples/s over `gpus` x the one-GPU run's (1.0: every GPU as fast as one alone)."""
    alone = next((r.get("samples_per_s_report") for r in rows if r["run"] == "one GPU"), None)
    for r in rows:
        rate = r.get("samples_per_s_report")
        if alone and rate and r["run"] != "one GPU":
            r["scaling_efficiency"] = round(rate / (gpus * alone), 3)


def shown(argv: List[str]) -> str:
    return " ".join(["python3", *map(shlex.quote, argv[1:])])


def nccl_mode(args, cluster: Cluster) -> str:
    return "-" if args.cpu else "sockets" if cluster.sockets else "default"


def nccl_suspect(row: dict) -> bool:
    """A failed run that NCCL may have caused: NCCL named in its output, or no step before the timeout."""
    text = "\n".join(row.get("driver_tail", []) + row.get("ray_log_tail", [])).lower()
    return "nccl" in text or (row.get("rc") is None and not STEP_LINE.search(text))


def file_tail(path: str, n: int) -> List[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in f.readlines()[-n:]]
    except OSError:
        return []


def read_report(out: str) -> dict:
    path = os.path.join(out, "report.json")
    if not os.path.isfile(path):
        raise Failed(f"no report at {path}")
    with open(path) as f:
        return json.load(f)


def progress_rate(driver: Driver) -> Optional[float]:
    """samples/s of the driver's last progress line."""
    for _, text in reversed(driver.lines):
        if STEP_LINE.search(text):
            m = RATE.search(text)
            return float(m.group(1).replace(",", "")) if m else None
    return None


def short_run(args, cluster: Cluster, spec: str, scratch: str, deadline: Deadline, name: str = "") -> dict:
    own_name, strategy, extra = run_spec(spec)
    name = name or own_name
    out = os.path.join(scratch, f"run-{name}")
    argv = train_argv(args, cluster, strategy, args.steps, out, extra)
    log(f"{strategy}: {shown(argv)}")
    driver = Driver(argv, cluster.env)
    rc = driver.wait(deadline.phase())
    row = {
        "run": name,
        "strategy": strategy,
        "command": shown(argv),
        "rc": rc,
        "nccl": nccl_mode(args, cluster),
        "wall_s": round(time.monotonic() - driver.started, 1),
        "driver_tail": driver.tail(),
    }
    if rc != 0:
        row["error"] = "timed out" if rc is None else f"exit {rc}"
        row["ray_log_tail"] = file_tail(os.path.join(out, "ray.log"), 80)
        return row
    report = read_report(out)
    summary, timing = report.get("summary") or {}, report.get("timing") or {}
    steady = timing.get("steady_step") or {}
    ips = sorted({p.get("ip") or p.get("host") for p in report.get("processes") or []})
    losses = [x for x in report.get("losses") or [] if x is not None]
    k = max(1, min(3, len(losses) // 4))
    first, last = (sum(losses[:k]) / k, sum(losses[-k:]) / k) if losses else (None, None)
    rate_report = steady.get("samples_per_s")
    rate_progress = progress_rate(driver)
    row.update(
        processes=summary.get("processes"),
        hosts=summary.get("hosts"),
        ips=ips,
        device=(report.get("devices") or {}).get("kind"),
        devices=(report.get("devices") or {}).get("count"),
        local_devices=[p.get("local_devices") for p in report.get("processes") or []],
        steps=report.get("steps"),
        step_ms=round(steady["median_s"] * 1e3, 2) if steady.get("median_s") else None,
        mfu=timing.get("mfu"),
        loss_first=first,
        loss_last=last,
        to_first_step_s=(timing.get("phases_s") or {}).get("to_first_step"),
        samples_per_s_progress=rate_progress,
        samples_per_s_report=rate_report,
        progress_over_report=round(rate_progress / rate_report, 3) if rate_progress and rate_report else None,
    )
    problems = []
    if row["processes"] != 2 or row["hosts"] != 2:
        problems.append(f"report says {row['processes']} processes on {row['hosts']} hosts ({ips}), not 2 on 2")
    if not (first is not None and last is not None and last < first):
        problems.append(f"losses did not fall ({first} -> {last})")
    if problems:
        row["error"] = "; ".join(problems)
    return row


def kill_run(args, cluster: Cluster, scratch: str, deadline: Deadline) -> dict:
    out = os.path.join(scratch, "run-kill")
    argv = train_argv(args, cluster, args.kill_strategy, args.kill_steps, out)
    log(f"kill: {shown(argv)}")
    driver = Driver(argv, cluster.env)
    limit = deadline.phase()
    row = {"run": "kill", "strategy": args.kill_strategy, "command": shown(argv), "nccl": nccl_mode(args, cluster)}
    try:
        end = driver.started + limit
        while driver.proc.poll() is None and driver.last_step() < args.kill_after and time.monotonic() < end:
            time.sleep(0.2)
        if driver.last_step() < args.kill_after:
            row["error"] = (
                f"the run ended (exit {driver.proc.returncode})" if driver.proc.poll() is not None else "timed out"
            ) + f" before step {args.kill_after}"
            return row
        pid = None
        while pid is None and time.monotonic() < end:
            pid = cluster.node_b_process()
            if pid is None:
                time.sleep(0.2)
        if pid is None:
            row["error"] = "no JaxProcess worker found on node B"
            return row
        placed = [PLACED.search(t) for _, t in driver.lines]
        ips = next((m.group(2).split(", ") for m in placed if m), [])
        row.update(
            processes=next((int(m.group(1)) for m in placed if m), None),
            ips=ips,
            hosts=len(set(ips)) or None,
            killed_pid=pid,
            killed_cmdline=cmdline(pid),
            killed_at_step=driver.last_step(),
        )
        seen = len(driver.lines)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        log(f"SIGKILL node B's JAX process (pid {pid}) at step {row['killed_at_step']}")
        named = None
        exit_by = killed + min(args.kill_wait, max(5.0, end - killed))
        while time.monotonic() < exit_by:
            for t, text in driver.lines[seen:]:
                if named is None and LOST_LINE.search(text):
                    named = (t, text)
            if named is not None and driver.proc.poll() is not None:
                break
            time.sleep(0.1)
        rc = driver.wait(max(1.0, exit_by - time.monotonic()))
        for t, text in driver.lines[seen:]:  # lines read after the loop's last look
            if named is None and LOST_LINE.search(text):
                named = (t, text)
        row.update(rc=rc, exit_s=round(time.monotonic() - killed, 2) if rc is not None else None)
        if named is None:
            row["error"] = f"the driver named no lost process within {args.kill_wait:.0f} s (exit {rc})"
        else:
            row.update(named_s=round(named[0] - killed, 2), named_line=named[1].strip(), names_node_b=NODE_B_IP in named[1])
            if row["named_s"] > NAMED_WITHIN_S or not row["names_node_b"] or rc in (0, None):
                row["error"] = (
                    f"named after {row['named_s']} s (target {NAMED_WITHIN_S:.0f}), node B named: {row['names_node_b']}, exit {rc}"
                )
        return row
    finally:
        driver.kill()
        row["driver_tail"] = driver.tail(60)
        row["wall_s"] = round(time.monotonic() - driver.started, 1)


# ---- the table and the record -------------------------------------------------------------------------
def fmt(v, spec: str = "") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) and spec else str(v)


def table(rows: List[dict]) -> str:
    header = [
        "run",
        "strategy",
        "nccl",
        "proc",
        "hosts",
        "host IPs",
        "step ms",
        "MFU",
        "loss first->last",
        "samples/s progress",
        "samples/s report",
        "ratio",
        "efficiency",
        "killed: s to named",
        "ok",
    ]
    cells = [header]
    for r in rows:
        loss = f"{r['loss_first']:.3f}->{r['loss_last']:.3f}" if r.get("loss_first") is not None and r.get("loss_last") is not None else "-"
        killed = f"{r['named_s']:.2f} (exit {r.get('rc')} at {fmt(r.get('exit_s'))} s)" if r.get("named_s") is not None else "-"
        cells.append(
            [
                r["run"],
                r.get("strategy") or "-",
                r.get("nccl") or "-",
                fmt(r.get("processes")),
                fmt(r.get("hosts")),
                " ".join(r.get("ips") or []) or "-",
                fmt(r.get("step_ms"), ".2f"),
                fmt(r.get("mfu"), ".3f"),
                loss,
                fmt(r.get("samples_per_s_progress"), ",.0f"),
                fmt(r.get("samples_per_s_report"), ",.1f"),
                fmt(r.get("progress_over_report"), ".3f"),
                fmt(r.get("scaling_efficiency"), ".3f"),
                killed,
                "yes" if not r.get("error") else "NO",
            ]
        )
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def save(out_dir: str, payload: dict) -> str:
    stamp = results.utc_stamp()
    nccl_lines = (payload.get("nccl") or {}).pop("lines", None)
    if nccl_lines:  # beside the JSON, as the workers wrote them
        log = results.result_path("gpu_two_nodes", out_dir, stamp, suffix="-nccl.log")
        payload["nccl"]["log"] = log.name
        log.write_text("\n".join(nccl_lines) + "\n")
    return results.write_json("gpu_two_nodes", payload, out_dir, stamp)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="no GPUs: a tiny GPT on --devices CPU devices per node")
    ap.add_argument(
        "--whl", default=os.path.join(REPO, ".whl"), help="make-ray-slim's OUTDIR, used when Ray is not installed (default: .whl)"
    )
    ap.add_argument("--preset", default="gpt-12l", help="GPU mode's model")
    ap.add_argument("--devices", type=int, default=1, help="--cpu: CPU devices per node")
    ap.add_argument(
        "--gpus-per-node",
        type=int,
        default=1,
        help="GPU mode: GPUs per node (node A the first ones); "
        "with 2 or more each node is a host of its own to NCCL (NVLink within, sockets across)",
    )
    ap.add_argument(
        "--strategies",
        nargs="*",
        default=["data", "fsdp"],
        help="STRATEGY, or NAME=STRATEGY+FLAG,VALUE,... for a variant with its own train flags (e.g. circ=pipeline+--pipeline-repeats,2)",
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--nccl-default",
        action="store_true",
        help="GPU mode: leave NCCL its own transports (NVLink between the two nodes' GPUs) instead of holding it to sockets",
    )
    ap.add_argument("--batch-size", type=int, default=0, help="GPU mode's global batch (default the preset's)")
    ap.add_argument("--pipeline-args", default="", help="extra train flags for --strategies pipeline, e.g. '--micro-batches 8'")
    ap.add_argument(
        "--one-gpu-batch",
        type=int,
        default=0,
        help="GPU mode: first the model on one GPU alone at this batch (no Ray), for the scaling-efficiency column",
    )
    ap.add_argument("--kill-steps", type=int, default=2000)
    ap.add_argument("--kill-after", type=int, default=10, help="kill node B's process after this step")
    ap.add_argument("--kill-strategy", default="data")
    ap.add_argument("--kill-wait", type=float, default=60.0, help="seconds to wait for the driver after the kill")
    ap.add_argument("--no-kill", action="store_true")
    ap.add_argument("--progress-every", type=int, default=5)
    ap.add_argument("--port", type=int, default=6390, help="the head's GCS port")
    ap.add_argument("--agent-port", type=int, default=52366, help="node B's dashboard agent listen port")
    ap.add_argument("--num-cpus", type=int, default=None, help="Ray CPUs per node (default 2 with --cpu, else 4)")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per phase")
    ap.add_argument("--deadline", type=float, default=420.0, help="seconds for the whole script")
    ap.add_argument("--scratch", default=None, help="run folders and Ray temp dirs (default: a new /tmp folder)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "bench", "results"))
    args = ap.parse_args()
    if args.num_cpus is None:
        args.num_cpus = 2 if args.cpu else 4
    deadline = Deadline(args.deadline, args.timeout)
    started = time.monotonic()
    env = base_env(args)
    # Short: Ray's socket paths live under it and Unix socket paths are limited to 107 bytes.
    scratch = args.scratch or tempfile.mkdtemp(prefix="tw2n-", dir="/tmp")
    rows: List[dict] = []
    payload: dict = {"mode": "cpu" if args.cpu else "gpu", "args": vars(args), "scratch": scratch, "command": results.command("python3")}
    cluster = None
    failure = None
    try:
        if args.one_gpu_batch and not args.cpu:
            rows.append(one_gpu_run(args, scratch, deadline))
            log("one GPU: " + (rows[-1].get("error") or f"{rows[-1]['step_ms']} ms/step"))
        payload["ray_site"] = ensure_ray(args.whl, env)
        cluster = Cluster(args, env, scratch, sockets=not (args.cpu or args.nccl_default))
        cluster.start(deadline)
        payload.update(node_commands=cluster.commands, nodes=cluster.nodes, head_ip=cluster.head_ip)
        for strategy in args.strategies:  # STRATEGY or NAME=STRATEGY+FLAG,VALUE,...
            rows.append(short_run(args, cluster, strategy, scratch, deadline))
            r = rows[-1]
            if r.get("error") and cluster.sockets and nccl_suspect(r):
                # One call on the GPU machine: rather than lose it to the socket-only setting, the nodes
                # start again with NCCL's default transports and the run is repeated (the table says so).
                log(f"{strategy} failed with NCCL held to sockets ({r['error']}); nodes again with NCCL's defaults")
                print("\n".join(r["driver_tail"][-20:]), flush=True)
                payload["left_alive"] = cluster.stop()
                cluster = Cluster(args, env, scratch, sockets=False)
                cluster.start(deadline)
                payload.update(fallback_node_commands=cluster.commands, nccl_fallback=r["error"])
                rows.append(short_run(args, cluster, strategy, scratch, deadline, name=f"{strategy}-nccl-default"))
                r = rows[-1]
            log(
                f"{strategy}: "
                + (
                    f"ERROR {r['error']}"
                    if r.get("error")
                    else f"{r['processes']} processes on {r['hosts']} hosts {r['ips']}, "
                    f"{r['step_ms']} ms/step, loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}"
                )
            )
            if r.get("error"):
                print("\n".join(r["driver_tail"][-20:]), flush=True)
        if not args.no_kill:
            rows.append(kill_run(args, cluster, scratch, deadline))
            r = rows[-1]
            if r.get("named_line"):
                log(f"named in {r['named_s']} s: {r['named_line']}")
            if r.get("error"):
                log(f"kill: ERROR {r['error']}")
                print("\n".join(r["driver_tail"][-20:]), flush=True)
    except (Failed, subprocess.SubprocessError, OSError) as err:
        failure = f"{type(err).__name__}: {err}"
        log(f"ERROR {failure}")
    finally:
        if cluster is not None:
            if not args.cpu:
                payload["nccl"] = dict(cluster.nccl_transports(), mode=nccl_mode(args, cluster))
                log(f"NCCL channels by transport (workers' logs): {payload['nccl']['channels_by_transport']}")
            payload["left_alive"] = cluster.stop()
    add_efficiency(rows, 2 * (1 if args.cpu else args.gpus_per_node))
    payload.update(rows=rows, failure=failure, wall_s=round(time.monotonic() - started, 1))
    text = table(rows)
    device = next((r.get("device") for r in rows if r.get("device")), "?")
    print(
        f"\ntwo Ray nodes on one machine ({payload['mode']}, {device}), head {payload.get('head_ip')} + "
        f"{NODE_B_IP}, wall {payload['wall_s']} s"
    )
    print(text)
    payload["table"] = text
    print("saved", save(args.out, payload))
    bad = failure or any(r.get("error") for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
