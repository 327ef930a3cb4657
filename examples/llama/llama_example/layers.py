"""A LLaMA-style decoder in plain Flax: RMSNorm, rotary position embeddings, a SwiGLU feed-forward
block and grouped-query attention.

Every parameter carries logical axis names (`embed`, `mlp`, `heads`, `kv`, `vocab`): the names the
kit's sharding rules know (`alpa_job.api` exports the same strings as EMBED, MLP, HEADS, KV, VOCAB),
so `fsdp` splits every weight over the data axis and `tensor` splits the feed-forward inner width,
the attention heads and the vocabulary over the model axis. This module needs only jax and flax;
`model.py` turns it into the kit's model spec.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

EMBED, MLP, HEADS, KV, VOCAB = "embed", "mlp", "heads", "kv", "vocab"

_normal = nn.initializers.normal(stddev=0.02)


def logical(init: Callable, axes: Tuple[Any, ...]) -> Callable:
    """The initializer with its logical axis names attached (flax's own mechanism; a flax too old to
    have it gets the bare initializer, and the Alpa engine plans the sharding itself)."""
    with_partitioning = getattr(nn, "with_logical_partitioning", None)
    return init if with_partitioning is None else with_partitioning(init, axes)


def products() -> dict:
    """The block's dense layers' product: the kit's api.dot_general where the kit is installed (so its
    `--precision fp8` reaches them; the output head stays in the compute dtype, as fp8 recipes keep it), jax's
    own otherwise: this module needs only jax and flax."""
    try:
        from alpa_job.api import dot_general
    except ImportError:
        return {}
    return {"dot_general": dot_general}


class RMSNorm(nn.Module):
    """x / rms(x) * scale, computed in float32 whatever the compute dtype."""

    epsilon: float = 1e-6
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", logical(nn.initializers.ones, (EMBED,)), (x.shape[-1],))
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.epsilon)
        return (normed * scale).astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling: stretches the long wavelengths by `factor` so a model
    trained on `original_max_len` tokens reads longer contexts, and leaves the short ones alone."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: Optional[RopeScaling] = None) -> np.ndarray:
    """The head_dim/2 angular frequencies theta^(-2i/head_dim), Llama-3-scaled when `scaling` is given.

    Computed in float64 numpy, once at trace time: they depend only on static sizes, so the one
    rounding to float32 is the only error rotary sees. Scaling: a wavelength shorter than original_max_len/high_freq_factor
    keeps its frequency, one longer than original_max_len/low_freq_factor is divided by factor, and
    between the two the frequency interpolates smoothly (clipping `smooth` to [0, 1] gives all three).
    """
    inv_freq = 1.0 / float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq
    wavelength = 2 * np.pi / inv_freq
    smooth = (scaling.original_max_len / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smooth = np.clip(smooth, 0.0, 1.0)
    return (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq


def rotary(x, theta: float = 10000.0, scaling: Optional[RopeScaling] = None):
    """Rotary position embedding over [batch, seq, heads, head_dim]: each pair (i, i + head_dim/2)
    of a position's vector turns by an angle proportional to the position, so q.k depends on the
    positions only through their difference. A rotation: every vector keeps its norm. The pairing by
    halves is Hugging Face's rotate_half, so its Llama checkpoints load without permuting q and k."""
    seq, dim = x.shape[1], x.shape[-1]
    inv_freq = jnp.asarray(rope_inverse_frequencies(dim, theta, scaling), jnp.float32)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def grouped_causal_attention(q, k, v, implementation: str = "auto"):
    """Causal attention with q [batch, seq, heads, d] and k, v [batch, seq, kv_heads, d]; query head
    h reads kv head h // (heads // kv_heads).

    "auto": cuDNN's fused attention on a GPU in bf16/fp16 (it takes the kv heads as they are);
    elsewhere, and on a jax without `dot_product_attention`, the einsum form below, which groups
    the query heads instead of copying k and v per group.
    """
    fused = getattr(jax.nn, "dot_product_attention", None)
    wants_cudnn = implementation == "cudnn" or (
        implementation == "auto" and fused is not None and jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
    )
    if wants_cudnn:
        return fused(q, k, v, is_causal=True, implementation="cudnn")
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / jnp.sqrt(head_dim).astype(q.dtype)
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", weights, v).reshape(batch, seq, heads, head_dim)


class Attention(nn.Module):
    """Grouped-query self-attention: num_heads query heads share num_kv_heads key/value heads."""

    num_heads: int
    num_kv_heads: int
    dtype: Any = jnp.float32
    rope_theta: float = 10000.0
    attention: str = "auto"  # "auto" | "cudnn" | "einsum" (see grouped_causal_attention)
    rope_scaling: Optional[RopeScaling] = None

    @nn.compact
    def __call__(self, x):
        d_model = x.shape[-1]
        head_dim = d_model // self.num_heads

        def project(heads, name):
            return nn.DenseGeneral(
                (heads, head_dim),
                use_bias=False,
                dtype=self.dtype,
                name=name,
                kernel_init=logical(_normal, (EMBED, HEADS, KV)),
                **products(),
            )(x)

        q = rotary(project(self.num_heads, "query"), self.rope_theta, self.rope_scaling)
        k = rotary(project(self.num_kv_heads, "key"), self.rope_theta, self.rope_scaling)
        v = project(self.num_kv_heads, "value")
        out = grouped_causal_attention(q, k, v, self.attention)
        return nn.DenseGeneral(
            d_model,
            axis=(-2, -1),
            use_bias=False,
            dtype=self.dtype,
            name="out",
            kernel_init=logical(_normal, (HEADS, KV, EMBED)),
            **products(),
        )(out)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    mlp_dim: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        def dense(features, axes, name):
            return nn.Dense(features, use_bias=False, dtype=self.dtype, name=name, kernel_init=logical(_normal, axes), **products())

        hidden = nn.silu(dense(self.mlp_dim, (EMBED, MLP), "gate")(x)) * dense(self.mlp_dim, (EMBED, MLP), "up")(x)
        return dense(x.shape[-1], (MLP, EMBED), "down")(hidden)


class DecoderBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + swiglu(norm(x))."""

    num_heads: int
    num_kv_heads: int
    mlp_dim: int
    dtype: Any = jnp.float32
    rope_theta: float = 10000.0
    attention: str = "auto"
    rope_scaling: Optional[RopeScaling] = None
    rms_norm_eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        norm = functools.partial(RMSNorm, epsilon=self.rms_norm_eps, dtype=self.dtype)
        attention = Attention(
            self.num_heads, self.num_kv_heads, self.dtype, self.rope_theta, self.attention, self.rope_scaling, name="attention"
        )
        x = x + attention(norm(name="attention_norm")(x))
        return x + SwiGLU(self.mlp_dim, self.dtype, name="mlp")(norm(name="mlp_norm")(x))


# What a block keeps for the backward pass: everything (none); only the products with a weight, the rest
# (attention scores, norms, SwiGLU's elementwise) recomputed (dots); nothing but its input (full).
REMAT_POLICIES = {"none": None, "dots": "dots_with_no_batch_dims_saveable", "full": "nothing_saveable"}


@functools.lru_cache(maxsize=None)
def block_class(remat: str) -> type:
    """DecoderBlock, or it under jax.checkpoint with `remat`'s policy: a subclass with the same parameters,
    made once per policy (so the kit's layer_class, DecoderBlock, still matches it)."""
    if remat == "none":
        return DecoderBlock
    policy = getattr(jax.checkpoint_policies, REMAT_POLICIES[remat])
    return nn.remat(DecoderBlock, policy=policy)


def decoder_block(model: "Llama", name: Optional[str] = None) -> DecoderBlock:
    """The block `model` stacks, with every setting it shares: the one place that lists them, so the
    block the kit's fast initialiser and pipeline build outside the model (model.repeated_blocks) is
    the block inside it."""
    return block_class(model.remat)(
        model.num_heads,
        model.num_kv_heads,
        model.mlp_dim,
        model.dtype,
        model.rope_theta,
        model.attention,
        model.rope_scaling,
        model.rms_norm_eps,
        name=name,
    )


class Llama(nn.Module):
    """tokens [batch, seq] -> logits [batch, seq, vocab] (causal: position t sees tokens 0..t).

    The output projection is its own weight (untied, as in LLaMA 1 and 2, and Llama 3's 8B and up)
    unless tie_embeddings, where the logits are x @ embedding.T (Llama 3.2's 1B and 3B); either
    matmul runs in the compute dtype and the loss upcasts the logits inside its log-softmax.
    """

    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    mlp_dim: int = 176
    vocab_size: int = 256
    dtype: Any = jnp.float32
    rope_theta: float = 10000.0
    attention: str = "auto"
    rope_scaling: Optional[RopeScaling] = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    remat: str = "none"  # REMAT_POLICIES: what each block keeps for the backward pass

    @nn.compact
    def __call__(self, tokens):
        # dtype: the lookup returns the compute dtype, and a tied head's attend multiplies in it.
        embed = nn.Embed(self.vocab_size, self.d_model, dtype=self.dtype, embedding_init=logical(_normal, (VOCAB, EMBED)), name="embed")
        x = embed(tokens)
        for i in range(self.num_layers):
            x = decoder_block(self, name=f"layer_{i}")(x)
        x = RMSNorm(epsilon=self.rms_norm_eps, dtype=self.dtype, name="final_norm")(x)
        if self.tie_embeddings:
            return embed.attend(x)
        return nn.Dense(self.vocab_size, use_bias=False, dtype=self.dtype, name="lm_head", kernel_init=logical(_normal, (EMBED, VOCAB)))(x)
