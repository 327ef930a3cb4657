"""The train step's model FLOPs, counted on its jaxpr: every matmul, convolution and fused attention.

Why not XLA's cost analysis: on a GPU the optimised executable's analysis hides the matmuls inside
cuBLAS custom calls (a GPT's count came out more than an order of magnitude low), and the lowered
module's analysis returned nothing at all. The jaxpr is what the program asks for before any
backend rewrites it, so the count is the same on every device and matches the usual MFU convention
(6 * params * tokens + 12 * layers * batch * seq^2 * d_model for a GPT: attention without a causal
discount).

Counted: dot_general (2 * batch * M * N * K), conv_general_dilated (2 * output elements * the
kernel's per-output multiply-adds), and cuDNN's fused attention (forward 4 * B * H * Sq * Sk * D,
backward twice that). Loops: a scan counts its body `length` times; a while loop's trip count is
unknown, so its body counts once; a cond counts its costliest branch. A shard_map's body is one device's
program, so it counts once per device of its manual mesh axes: what all the devices compute, which for a
pipeline includes the ticks a stage idles in (its bubble), as the devices do run them.
"""
from __future__ import annotations

import math
from typing import Any, Iterator


# Dense matmul rates (FLOP/s) by jax's device_kind and the precision a step's matmuls run in: (measured on
# the lent GPUs, a jitted product of random matrices, None where not measured; the vendor's datasheet
# number, dense). MFU is reported on both bases; the planner's GPU peaks are the measured bf16.
PEAKS = {
    "NVIDIA H100 80GB HBM3": {"bf16": (798e12, 989.4e12), "tf32": (None, 494.7e12), "fp8": (None, 1978.9e12)},
    "NVIDIA H200": {"bf16": (788e12, 989.4e12), "tf32": (341e12, 494.7e12), "fp8": (1116e12, 1978.9e12)},
}
PEAK_BF16_FLOPS = {kind: rates["bf16"][0] for kind, rates in PEAKS.items()}


def precision_of(dtype: str) -> str:
    """The precision a run's matmuls run in: bf16 under --dtype bfloat16; float32 runs on Hopper's TF32 tensor
    cores (jax's default matmul precision there)."""
    return {"bfloat16": "bf16", "float8": "fp8"}.get(dtype, "tf32")


def matmul_dtype(config) -> str:
    """The dtype a run's dense products run in, for its peak: float8 under --precision fp8, else --dtype."""
    return "float8" if getattr(config, "precision", "dtype") == "fp8" else config.dtype


def peak(device_kind: str, dtype: str) -> dict:
    """{"precision", "measured", "datasheet"} (FLOP/s, None where unknown) for a run on `device_kind` (a
    device not in PEAKS, a CPU: float32 stays fp32)."""
    known = PEAKS.get(device_kind or "")
    precision = precision_of(dtype)
    if not known and precision == "tf32":  # TF32 is what the known (Hopper) cards run float32 on; elsewhere fp32
        precision = "fp32"
    measured, datasheet = (known or {}).get(precision, (None, None))
    return {"precision": precision, "measured": measured, "datasheet": datasheet}


def _size(shape) -> int:
    return int(math.prod(shape))


def _dot_general(eqn) -> float:
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
    rhs_free = [d for i, d in enumerate(rhs) if i not in rhs_contract and i not in rhs_batch]
    return 2.0 * _size(lhs) * _size(rhs_free)


def _conv(eqn) -> float:
    out = eqn.outvars[0].aval.shape
    rhs = eqn.invars[1].aval.shape
    out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
    return 2.0 * _size(out) * _size(rhs) / rhs[out_feature_dim]


def _attention(eqn) -> float:
    q, k = (v.aval.shape for v in eqn.invars[:2])  # [batch, seq, heads, head_dim]
    forward = 4.0 * q[0] * q[2] * q[1] * k[1] * q[3]
    return 2 * forward if "bwd" in eqn.primitive.name else forward


def _inner(eqn) -> Iterator[Any]:
    for value in eqn.params.values():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            jaxpr = getattr(item, "jaxpr", item)  # ClosedJaxpr -> Jaxpr
            if hasattr(jaxpr, "eqns"):
                yield jaxpr


def _manual_devices(params) -> int:
    """How many devices run a shard_map's body: the product of its manual mesh axes' sizes."""
    sizes = dict(params["mesh"].shape)
    if "newly_manual_axes" in params:
        manual = params["newly_manual_axes"]
    else:  # older jax names the axes left automatic instead
        manual = set(sizes) - set(params.get("auto", ()))
    return int(math.prod(sizes[axis] for axis in manual))


def jaxpr_flops(jaxpr) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot_general(eqn)
        elif name == "conv_general_dilated":
            total += _conv(eqn)
        elif "dot_product_attention" in name:
            total += _attention(eqn)
        elif name == "cond":
            total += max((jaxpr_flops(b.jaxpr) for b in eqn.params["branches"]), default=0.0)
        elif name == "scan":
            total += eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"].jaxpr)
        elif name == "shard_map":
            total += _manual_devices(eqn.params) * jaxpr_flops(getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"]))
        else:
            total += sum(jaxpr_flops(inner) for inner in _inner(eqn))
    return total


def step_flops(traced) -> float:
    """Model FLOPs of one call of a traced function (`jax.jit(f).trace(...)`), all devices together."""
    return jaxpr_flops(traced.jaxpr.jaxpr)
