"""What the kit sees of a GPU cluster's network, on one machine of two GPUs (issue 39's GPU proof).

1. Two Ray nodes of one GPU each, NCCL held to sockets as two hosts without InfiniBand (gpu_two_nodes.py's
   nodes, without its NCCL_DEBUG: the kit asks NCCL for its own log):
   - `python -m alpa_job doctor --network --format json`: the link between the nodes, the all-reduce's bus
     bandwidth and NCCL's transports;
   - a training run: its report's `network_measured`, each process's `nccl` transports, its `stragglers`;
   - the same run while another process keeps node B's GPU busy (a matmul loop on it): the straggler named.
2. One Ray node with both GPUs, NCCL's own choice: `doctor --network`, whose all-reduce runs over NVLink,
   and the same training run on it: one process of two GPUs, whose report must carry the same transports.

    python3 bench/gpu_network.py --whl .whl --out "$OUT/results"
    python3 bench/gpu_network.py --whl .whl --parts one-node     # only part 2

Prints what each phase found and saves OUT/gpu_network-<UTC time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict

import gpu_two_nodes as two  # the two-node machinery is that bench's
from lib import results

HOG = """
import jax, jax.numpy as jnp, time
x = jax.random.normal(jax.random.PRNGKey(0), (8192, 8192), jnp.bfloat16)
f = jax.jit(lambda a: jnp.tanh(a @ a))
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    x = f(x); x.block_until_ready()
"""


class QuietNodes(two.Cluster):
    """gpu_two_nodes' nodes without NCCL_DEBUG in their environment (the kit's own NCCL log is what is proven)."""

    def node_env(self, which: str) -> Dict[str, str]:
        env = super().node_env(which)
        for key in two.NCCL_DEBUG:
            env.pop(key, None)
        return env


def doctor(address: str, env: Dict[str, str], timeout_s: float) -> dict:
    argv = [sys.executable, "-m", "alpa_job", "doctor", "--address", address, "--network", "--format", "json", "--deadline", "90"]
    two.log("doctor: " + two.shown(argv))
    p = subprocess.run(argv, cwd=two.REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    try:
        result = json.loads(p.stdout)
    except ValueError:
        return {"rc": p.returncode, "error": (p.stdout + p.stderr)[-2000:]}
    network = result.get("network") or {}
    network_words = ("nccl", "all-reduce", "link", "network", "route", "transport")
    checks = [
        c
        for c in result.get("checks", [])
        if not c.get("ok") or c.get("warn") or any(w in (c.get("name") or "").lower() for w in network_words)
    ]
    found = {
        "rc": p.returncode,
        "links": network.get("links"),
        "all_reduce": network.get("all_reduce"),
        "median_gbps": network.get("median_gbps"),
        "checks": checks,
    }
    two.log(
        f"doctor rc {p.returncode}: links {[(r.get('src'), r.get('dst'), r.get('gbps')) for r in found['links'] or []]}"
        f"; all-reduce {found['all_reduce']}"
    )
    for c in checks:
        two.log(f"  {'ok' if c.get('ok') else 'FAIL'} {c.get('name')} {c.get('node') or ''}: {(c.get('detail') or '')[:200]}")
    return found


def train(address: str, out: str, steps: int, env: Dict[str, str], deadline: two.Deadline) -> dict:
    argv = [
        sys.executable,
        "-m",
        "alpa_job",
        "train",
        "--address",
        address,
        "--model",
        "gpt",
        "--num-layers",
        "6",
        "--d-model",
        "1024",
        "--num-heads",
        "16",
        "--seq-len",
        "1024",
        "--vocab-size",
        "32768",
        "--dtype",
        "bfloat16",
        "--batch-size",
        "16",
        "--num-samples",
        "256",
        "--epochs",
        str(steps // 8 + 2),
        "--steps",
        str(steps),
        "--strategy",
        "data",
        "--out",
        out,
        "--progress-every",
        "25",
        "--compile-cache",
        "none",
    ]
    two.log("train: " + two.shown(argv))
    driver = two.Driver(argv, env)
    rc = driver.wait(deadline.phase())
    found = {"rc": rc, "tail": driver.tail(30)}
    if rc != 0:
        two.log(f"train exit {rc}: " + " | ".join(driver.tail(8)))
        return found
    report = json.loads(open(os.path.join(out, "report.json")).read())
    steady = (report.get("timing") or {}).get("steady_step") or {}
    found.update(
        network_measured=report.get("network_measured"),
        nccl=[p.get("nccl") and {k: p["nccl"][k] for k in ("transports", "channels", "verdicts")} for p in report["processes"]],
        stragglers={k: (report.get("stragglers") or {}).get(k) for k in ("latest", "events", "slow_now")},
        step_ms=round(steady["median_s"] * 1e3, 2) if steady.get("median_s") else None,
        lines=[t for t in driver.tail(60) if "straggler" in t or "network:" in t or "slow:" in t],
    )
    two.log(f"train: step {found['step_ms']} ms; network {found['network_measured']}; nccl {found['nccl']}")
    two.log(f"  stragglers {found['stragglers']}")
    for line in found["lines"]:
        two.log("  | " + line)
    return found


def one_node(args, env: Dict[str, str], scratch: str, deadline: two.Deadline) -> dict:
    """Both GPUs in one Ray node, NCCL's own transports: the doctor's all-reduce over them, and a training run's
    report (one process driving both GPUs)."""
    tag = "tw2n-one-" + str(os.getpid())
    node_env = dict(env, CUDA_VISIBLE_DEVICES="0,1", **{two.TAG_VAR: tag})
    port = args.port + 7
    argv = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--node-ip-address",
        "127.0.0.1",
        "--port",
        str(port),
        "--temp-dir",
        os.path.join(scratch, "ray-one"),
        "--include-dashboard=false",
        "--num-cpus",
        "8",
        "--num-gpus",
        "2",
        "--disable-usage-stats",
    ]
    p = subprocess.run(argv, env=node_env, capture_output=True, text=True, timeout=deadline.phase())
    if p.returncode != 0:
        return {"error": (p.stdout + p.stderr)[-1500:]}
    try:
        found = {"doctor": doctor(f"127.0.0.1:{port}", env, deadline.phase())}
        found["train"] = train(f"127.0.0.1:{port}", os.path.join(scratch, "one-node"), args.steps, env, deadline)
        return found
    finally:
        two.stop_tagged(tag)


def two_nodes(args, env: Dict[str, str], scratch: str, deadline: two.Deadline) -> Dict[str, object]:
    """Two Ray nodes of one GPU each over sockets: the doctor, a clean training run, and one beside a GPU hog."""
    result: Dict[str, object] = {}
    cluster = QuietNodes(args, env, scratch, sockets=True)
    hog = None
    try:
        cluster.start(deadline)
        result["two_nodes_doctor"] = doctor(cluster.address, env, deadline.phase())
        result["two_nodes_train"] = train(cluster.address, os.path.join(scratch, "clean"), args.steps, env, deadline)
        hog = subprocess.Popen(
            [sys.executable, "-c", HOG.format(seconds=int(deadline.left()))],
            env=dict(env, CUDA_VISIBLE_DEVICES="1", XLA_PYTHON_CLIENT_MEM_FRACTION="0.1"),
        )
        time.sleep(8)  # its compile done: node B's GPU is shared from the first step on
        result["two_nodes_train_gpu1_busy"] = train(cluster.address, os.path.join(scratch, "busy"), args.steps, env, deadline)
    except (two.Failed, subprocess.TimeoutExpired) as err:
        result["error"] = str(err)
        two.log(f"FAILED: {err}")
    finally:
        if hog is not None:
            hog.kill()
        cluster.stop()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--whl", default=None)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--port", type=int, default=6391)
    parser.add_argument("--agent-port", type=int, default=52366)
    parser.add_argument("--deadline", type=float, default=560)
    parser.add_argument("--timeout", type=float, default=200)
    parser.add_argument("--parts", nargs="+", choices=["two-nodes", "one-node"], default=["two-nodes", "one-node"])
    args = parser.parse_args()
    # What gpu_two_nodes' Cluster reads from its own arguments.
    args.cpu, args.gpus_per_node, args.num_cpus, args.progress_every = False, 1, 8, 25
    deadline = two.Deadline(args.deadline, args.timeout)
    env = two.base_env(args)
    two.ensure_ray(args.whl, env)
    scratch = tempfile.mkdtemp(prefix="gpu-network-")
    result: Dict[str, object] = {}
    if "two-nodes" in args.parts:
        result.update(two_nodes(args, env, scratch, deadline))
    try:
        if "one-node" in args.parts:
            result["one_node"] = one_node(args, env, scratch, deadline)
    except (two.Failed, subprocess.TimeoutExpired) as err:
        result["one_node_error"] = str(err)
    path = results.write_json("gpu_network", {"command": results.command("python3"), **result}, args.out)
    two.log(f"saved {path}")
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
