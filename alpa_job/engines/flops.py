"""The train step's model FLOPs, counted on its jaxpr: every matmul, convolution and fused attention.

Why not XLA's cost analysis: on a GPU the optimised executable's analysis hides the matmuls inside
cuBLAS custom calls (a GPT's count came out more than an order of magnitude low), and the lowered
module's analysis returned nothing at all. The jaxpr is what the program asks for before any
backend rewrites it, so the count is the same on every device.

Two counts. The full count: every product at its whole size (6 * params * tokens + 12 * layers * batch *
seq^2 * d_model for a GPT). MaxText's count (`calculate_tflops_training_per_device`, after Megatron-LM and
NeMo), the one the report's MFU uses: causal attention's products at half, since the masked upper triangle
of the scores is no useful work (6 * params * tokens + 6 * layers * batch * seq^2 * d_model for a GPT).
Which products are causal attention: cuDNN's fused attention says so itself (its causal mask); in the einsum
form, under a model that declares `api.Model.causal_attention`, every product between two activations
(a dot_general with batch dimensions, over batch and heads) that makes the [.., seq_q, seq_k] scores
(q.k^T, and dO.v^T in the backward) or reads them (probabilities.v, and the backward's three).
A model that declares nothing gets the full count for its einsum attention.

Counted: dot_general (2 * batch * M * N * K), conv_general_dilated (2 * output elements * the
kernel's per-output multiply-adds), and cuDNN's fused attention (forward 4 * B * H * Sq * Sk * D,
backward twice that). Loops: a scan counts its body `length` times; a while loop's trip count is
unknown, so its body counts once; a cond counts its costliest branch. A shard_map's body is one device's
program, so it counts once per device of its manual mesh axes: what all the devices compute, which for a
pipeline includes the ticks a stage idles in (its bubble), as the devices do run them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Optional


# Dense matmul rates (FLOP/s) by jax's device_kind and the precision a step's matmuls run in: (measured on
# the lent GPUs, a jitted product of random matrices, None where not measured; the vendor's datasheet
# number, dense). MFU is reported on both bases. The planner's peaks come from its GPU profiles
# (planner/profiles/, written by `plan calibrate`) where the kit ships one, else from the measured bf16 here.
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


@dataclasses.dataclass(frozen=True)
class FlopCount:
    """A program's FLOPs: `total`, every product at its whole size, and `causal_attention`, the part of it
    that causal attention's products make (at their whole size too)."""

    total: float = 0.0
    causal_attention: float = 0.0

    def __add__(self, other: "FlopCount") -> "FlopCount":
        return FlopCount(self.total + other.total, self.causal_attention + other.causal_attention)

    def times(self, n: float) -> "FlopCount":
        return FlopCount(n * self.total, n * self.causal_attention)

    @property
    def maxtext(self) -> float:
        """MaxText's count: causal attention at half."""
        return self.total - self.causal_attention / 2


def maxtext_flops(total: Optional[float], causal_attention: Optional[float]) -> Optional[float]:
    """MaxText's count from the full one and its causal attention part (None: none counted)."""
    return None if total is None else FlopCount(total, causal_attention or 0.0).maxtext


def _size(shape) -> int:
    return int(math.prod(shape))


def _dot_general(eqn) -> float:
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
    rhs_free = [d for i, d in enumerate(rhs) if i not in rhs_contract and i not in rhs_batch]
    return 2.0 * _size(lhs) * _size(rhs_free)


def _free_sizes(shape, contract, batch) -> set:
    return {d for i, d in enumerate(shape) if i not in contract and i not in batch}


def _is_attention_product(eqn) -> bool:
    """A product between two activations (batched, over batch and heads: a dense layer's weight has no batch
    dimension) that makes a [.., seq_q, seq_k] score tensor (a query position free on one side, a key position
    of the same length on the other: q.k^T, dO.v^T) or reads one (it sums over a position while keeping one of
    the same length: probabilities.v, dS.k, dS^T.q, P^T.dO)."""
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    if not lhs_batch:
        return False
    lhs_free, rhs_free = _free_sizes(lhs, lhs_contract, lhs_batch), _free_sizes(rhs, rhs_contract, rhs_batch)
    makes_scores = bool(lhs_free & rhs_free)
    reads_scores = any(lhs[i] in lhs_free for i in lhs_contract) or any(rhs[i] in rhs_free for i in rhs_contract)
    return makes_scores or reads_scores


def _conv(eqn) -> float:
    out = eqn.outvars[0].aval.shape
    rhs = eqn.invars[1].aval.shape
    out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
    return 2.0 * _size(out) * _size(rhs) / rhs[out_feature_dim]


def _attention(eqn) -> float:
    q, k = (v.aval.shape for v in eqn.invars[:2])  # [batch, seq, heads, head_dim]
    forward = 4.0 * q[0] * q[2] * q[1] * k[1] * q[3]
    return 2 * forward if "bwd" in eqn.primitive.name else forward


def _cudnn_causal(params) -> bool:
    """cuDNN's fused attention under a plain causal mask (a sliding window would mask more than half)."""
    mask = params.get("mask_type")
    return "CAUSAL" in str(getattr(mask, "name", mask)).upper() and not params.get("sliding_window_length")


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


def _product(flops: float, causal: bool) -> FlopCount:
    return FlopCount(flops, flops if causal else 0.0)


def jaxpr_count(jaxpr, causal_attention: bool = False) -> FlopCount:
    """The jaxpr's FLOPs; `causal_attention`: the model declares its (einsum) attention causal."""
    total = FlopCount()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _product(_dot_general(eqn), causal_attention and _is_attention_product(eqn))
        elif name == "conv_general_dilated":
            total += FlopCount(_conv(eqn))
        elif "dot_product_attention" in name:
            total += _product(_attention(eqn), _cudnn_causal(eqn.params))
        elif name == "cond":
            branches = [jaxpr_count(b.jaxpr, causal_attention) for b in eqn.params["branches"]]
            total += max(branches, key=lambda count: count.total, default=FlopCount())
        elif name == "scan":
            total += jaxpr_count(eqn.params["jaxpr"].jaxpr, causal_attention).times(eqn.params["length"])
        elif name == "shard_map":
            body = getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"])
            total += jaxpr_count(body, causal_attention).times(_manual_devices(eqn.params))
        else:
            for inner in _inner(eqn):
                total += jaxpr_count(inner, causal_attention)
    return total


def jaxpr_flops(jaxpr) -> float:
    return jaxpr_count(jaxpr).total


def step_count(traced, causal_attention: bool = False) -> FlopCount:
    """Model FLOPs of one call of a traced function (`jax.jit(f).trace(...)`), all devices together, with
    the part causal attention makes (`causal_attention`: the model declares its attention causal)."""
    return jaxpr_count(traced.jaxpr.jaxpr, causal_attention)


def step_flops(traced) -> float:
    """Model FLOPs of one call of a traced function (`jax.jit(f).trace(...)`), all devices together."""
    return step_count(traced).total
