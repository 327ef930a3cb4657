"""fp8 matmuls for `--precision fp8`: the dense layers' products in float8 (e4m3 forward, e5m2 gradients), the
rest of the step in bf16, on Hopper's fp8 tensor cores.

Scaling is per tensor and current: each operand's scale is its own absolute maximum this step over the format's
largest value (what torchtitan's Float8 training uses by default), so there is no scaling state to keep, restore
or split between pipeline stages, and a resumed run scales exactly as an uninterrupted one. The cost is one
reduction over each operand before its product.

The products take the fp8 arrays themselves (XLA compiles a dot of fp8 operands into cuBLASLt's fp8 GEMM, with
a bf16 result), and the result is multiplied by the two scales. The backward is written out (a custom VJP): the
incoming gradient is quantised to e5m2 and multiplied with the forward's fp8 operands, which are what it keeps
(half the bytes of bf16 copies). On a CPU the same arithmetic runs emulated: the numbers of fp8 training, not its
speed.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# Hopper (9.0) and Ada (8.9) have fp8 tensor cores; what cuBLASLt's fp8 GEMMs need.
MIN_COMPUTE_CAPABILITY = (8, 9)


def quantize(x, fp8):
    """(x on the fp8 grid at its own scale, in fp8; that scale, float32): amax maps to the largest finite value."""
    largest = jnp.float32(jnp.finfo(fp8).max)
    scale = lax.stop_gradient(jnp.maximum(jnp.max(jnp.abs(x)).astype(jnp.float32), 1e-12) / largest)
    return jnp.clip(x.astype(jnp.float32) / scale, -largest, largest).astype(fp8), scale


def _product(q_lhs, q_rhs, scale, dimension_numbers, out_dtype):
    out = lax.dot_general(q_lhs, q_rhs, dimension_numbers, preferred_element_type=out_dtype)
    return out * scale.astype(out_dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_dot(lhs, rhs, dimension_numbers):
    return _fp8_dot_fwd(lhs, rhs, dimension_numbers)[0]


def _fp8_dot_fwd(lhs, rhs, dimension_numbers):
    (q_lhs, s_lhs), (q_rhs, s_rhs) = quantize(lhs, E4M3), quantize(rhs, E4M3)
    out = _product(q_lhs, q_rhs, s_lhs * s_rhs, dimension_numbers, lhs.dtype)
    # The dtypes as zero-size arrays: what the gradients are returned in.
    return out, (q_lhs, s_lhs, q_rhs, s_rhs, jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))


def _fp8_dot_bwd(dimension_numbers, saved, g):
    from flax.linen.fp8_ops import dot_general_transpose_lhs, dot_general_transpose_rhs

    q_lhs, s_lhs, q_rhs, s_rhs, lhs_kind, rhs_kind = saved
    q_g, s_g = quantize(g, E5M2)  # e5m2's range: gradients span more decades than activations
    d_lhs = dot_general_transpose_lhs(
        q_g, q_lhs, q_rhs, dimension_numbers=dimension_numbers, precision=None, preferred_element_type=lhs_kind.dtype
    )
    d_rhs = dot_general_transpose_rhs(
        q_g, q_lhs, q_rhs, dimension_numbers=dimension_numbers, precision=None, preferred_element_type=rhs_kind.dtype
    )
    return (d_lhs * (s_g * s_rhs).astype(lhs_kind.dtype), d_rhs * (s_g * s_lhs).astype(rhs_kind.dtype))


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """lax.dot_general with both operands in e4m3 and, in the backward, the incoming gradient in e5m2. The result
    is in the operands' dtype (the step's bf16); `precision` does not apply to fp8 products."""
    dimension_numbers = tuple(tuple(tuple(axes) for axes in pair) for pair in dimension_numbers)
    out = _fp8_dot(lhs, rhs, dimension_numbers)
    return out if preferred_element_type is None else out.astype(preferred_element_type)


def unsupported_gpu(devices) -> str:
    """'' when every GPU of `devices` has fp8 tensor cores, else the first one that does not, described."""
    for device in devices:
        capability = getattr(device, "compute_capability", None)
        if device.platform == "gpu" and capability is not None:
            major, minor = (int(x) for x in str(capability).split(".")[:2])
            if (major, minor) < MIN_COMPUTE_CAPABILITY:
                return f"{device.device_kind} (compute capability {capability})"
    return ""
