"""What two GPU processes held to NCCL's sockets can send, and whether a permute hides behind compute.

Two JAX processes on one machine, one GPU each, joined by jax.distributed and held to sockets as two hosts
without InfiniBand (gpu_two_nodes.py's NCCL settings). For each NCCL socket setting asked (`--variants`:
NAME=VAR=VALUE,VAR=VALUE), process 0 times:

- an all-reduce (psum) of 256 MiB of fp32 and of the same elements in bf16 (a pipeline's shell gradients);
- a permute of 16 MiB to the other process (a GPT 24L micro-batch's activations between stages);
- a chain of matmuls alone, and the same chain in one program with an independent permute: whether XLA
  runs the permute while the GPU computes (overlapped: close to the matmuls alone; serial: their sum).

    python3 bench/gpu_socket_collectives.py --out "$OUT/results"

Prints a table and saves OUT/gpu_socket_collectives-<UTC time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

from gpu_two_nodes import NCCL_OVER_SOCKETS  # held to sockets as gpu_two_nodes' two hosts are
from lib import results


def timed(fn, *args, repeats: int = 5) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(process: int, port: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    jax.distributed.initialize(f"127.0.0.1:{port}", 2, process)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    shard_map = jax.shard_map

    def global_array(shape, dtype):
        local = np.ones((shape[0] // 2,) + shape[1:], dtype)
        return jax.make_array_from_callback(shape, NamedSharding(mesh, P("x")), lambda where: local)

    def spmd(fn, n_in):
        return jax.jit(shard_map(fn, mesh=mesh, in_specs=(P("x"),) * n_in, out_specs=P("x")))

    found: Dict[str, float] = {}
    big = 256 << 20
    psum = spmd(lambda a: jax.lax.psum(a, "x"), 1)
    found["psum_fp32_256MiB_ms"] = timed(psum, global_array((2 * big // 4,), np.float32)) * 1e3
    found["psum_bf16_128MiB_ms"] = timed(psum, global_array((2 * big // 4,), jnp.bfloat16)) * 1e3
    act = 16 << 20
    permute = spmd(lambda a: jax.lax.ppermute(a, "x", [(0, 1)]), 1)
    activations = global_array((2 * act // 2,), jnp.bfloat16)
    found["permute_16MiB_ms"] = timed(permute, activations) * 1e3
    both_ways = spmd(lambda a: jax.lax.ppermute(a, "x", [(0, 1), (1, 0)]), 1)
    found["permute_16MiB_both_ways_ms"] = timed(both_ways, activations) * 1e3

    def chain(a):
        for _ in range(8):
            a = jnp.tanh(a @ a)
        return a

    mats = global_array((2 * 4096, 4096), jnp.bfloat16)
    found["matmuls_ms"] = timed(spmd(chain, 1), mats) * 1e3
    overlapped = jax.jit(
        shard_map(
            lambda a, x: (chain(a), jax.lax.ppermute(x, "x", [(0, 1)])),
            mesh=mesh,
            in_specs=(P("x"), P("x")),
            out_specs=(P("x"), P("x")),
        )
    )
    found["matmuls_with_permute_ms"] = timed(overlapped, mats, activations) * 1e3
    if process == 0:
        print("RESULT " + json.dumps({k: round(v, 3) for k, v in found.items()}), flush=True)


def run_variant(name: str, extra: Dict[str, str], port: int, timeout_s: float) -> Dict[str, object]:
    procs = []
    for process in range(2):
        env = dict(os.environ, **NCCL_OVER_SOCKETS, **extra, CUDA_VISIBLE_DEVICES=str(process), NCCL_HOSTID=f"host{process}")
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", str(process), "--port", str(port)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs: List[str] = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return {"variant": name, "env": extra, "error": f"no result in {timeout_s} s"}
    for line in outputs[0].splitlines():
        if line.startswith("RESULT "):
            return {"variant": name, "env": extra, **json.loads(line[len("RESULT ") :])}
    return {"variant": name, "env": extra, "error": (outputs[0] + outputs[1])[-2000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=int, default=None)
    parser.add_argument("--port", type=int, default=6481)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument(
        "--variants",
        nargs="*",
        default=["default=", "4x4=NCCL_SOCKET_NTHREADS=4,NCCL_NSOCKS_PERTHREAD=4", "8x8=NCCL_SOCKET_NTHREADS=8,NCCL_NSOCKS_PERTHREAD=8"],
    )
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.port)
        return 0
    rows = []
    for i, variant in enumerate(args.variants):
        name, _, settings = variant.partition("=")
        extra = dict(kv.split("=", 1) for kv in settings.split(",") if kv)
        row = run_variant(name, extra, args.port + i, args.timeout)
        print(json.dumps(row), flush=True)
        rows.append(row)
    path = results.write_json("gpu_socket_collectives", {"command": results.command("python3"), "rows": rows}, args.out)
    print(f"saved {path}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
