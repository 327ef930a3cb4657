"""The dense matmul rate one GPU reaches in each precision a training run computes in: what MFU's measured
basis divides by (the datasheet basis is the vendor's number).

An N^3 product on random data, jitted, timed over REPEATS runs after a warm-up (the median). float32 is
timed twice: at jax's default precision (on Hopper, TF32 tensor cores: what a float32 run gets) and at
HIGHEST (true fp32 FMAs). fp8 multiplies e4m3 operands into a bfloat16 result, as fp8 training does.

    python3 bench/gpu_peaks.py --size 8192
"""

from __future__ import annotations

import argparse
import statistics
import time

from lib.results import save_result


def rate(size: int, kind: str, repeats: int) -> float:
    import jax
    import jax.numpy as jnp

    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(key_a, (size, size), jnp.float32)
    b = jax.random.normal(key_b, (size, size), jnp.float32)
    if kind == "bf16":
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        fn = jax.jit(lambda x, y: x @ y)
    elif kind == "fp32-default":
        fn = jax.jit(lambda x, y: x @ y)
    elif kind == "fp32-highest":
        fn = jax.jit(lambda x, y: jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST))
    elif kind == "fp8":
        a, b = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)
        fn = jax.jit(lambda x, y: jax.lax.dot(x, y, preferred_element_type=jnp.bfloat16))
    else:
        raise ValueError(kind)
    fn(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2.0 * size**3 / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--kinds", default="bf16,fp32-default,fp32-highest,fp8")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()

    rows = {}
    for kind in args.kinds.split(","):
        try:
            rows[kind] = round(rate(args.size, kind, args.repeats) / 1e12, 1)
        except Exception as err:  # noqa: BLE001 - a precision this GPU or jax lacks: said in its row
            rows[kind] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
        print(f"{kind:14} {rows[kind]} TFLOP/s", flush=True)
    print("saved", save_result("gpu_peaks", args.out, {"size": args.size, "tflops": rows}))


if __name__ == "__main__":
    main()
