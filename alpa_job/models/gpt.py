"""A decoder-only transformer (GPT-style): pre-LayerNorm, causal self-attention, GELU MLP."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from alpa_job.models.axes import EMBED, HEADS, KV, MLP, SEQ, VOCAB, logical

_normal = nn.initializers.normal(stddev=0.02)


def _layer_norm(dtype: Any) -> nn.LayerNorm:
    return nn.LayerNorm(
        dtype=dtype,
        scale_init=logical(nn.initializers.ones_init(), (EMBED,)),
        bias_init=logical(nn.initializers.zeros_init(), (EMBED,)),
    )


def causal_attention(q, k, v):
    """Causal softmax attention over [batch, seq, heads, head_dim].

    jax.nn.dot_product_attention lets XLA pick a fused kernel (cuDNN flash attention on GPUs);
    jax 0.3.22 (the Alpa image) lacks it, so the plain einsum form is the fallback.
    """
    fused = getattr(jax.nn, "dot_product_attention", None)
    if fused is not None:
        return fused(q, k, v, is_causal=True)
    seq, head_dim = q.shape[1], q.shape[-1]
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(q.dtype)
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class CausalSelfAttention(nn.Module):
    num_heads: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        d_model = x.shape[-1]
        head_dim = d_model // self.num_heads
        qkv = nn.DenseGeneral(
            (3, self.num_heads, head_dim), dtype=self.dtype, name="qkv",
            kernel_init=logical(_normal, (EMBED, None, HEADS, KV)),
            bias_init=logical(nn.initializers.zeros_init(), (None, HEADS, KV)),
        )(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        out = causal_attention(q, k, v)
        return nn.DenseGeneral(
            d_model, axis=(-2, -1), dtype=self.dtype, name="out",
            kernel_init=logical(_normal, (HEADS, KV, EMBED)),
            bias_init=logical(nn.initializers.zeros_init(), (EMBED,)),
        )(out)


class DecoderBlock(nn.Module):
    num_heads: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = x + CausalSelfAttention(self.num_heads, self.dtype)(_layer_norm(self.dtype)(x))
        d_model = x.shape[-1]
        y = nn.Dense(4 * d_model, dtype=self.dtype, kernel_init=logical(_normal, (EMBED, MLP)),
                     bias_init=logical(nn.initializers.zeros_init(), (MLP,)))(_layer_norm(self.dtype)(x))
        y = nn.gelu(y)
        y = nn.Dense(d_model, dtype=self.dtype, kernel_init=logical(_normal, (MLP, EMBED)),
                     bias_init=logical(nn.initializers.zeros_init(), (EMBED,)))(y)
        return x + y


class GPT(nn.Module):
    num_layers: int = 2
    d_model: int = 128
    num_heads: int = 4
    seq_len: int = 64
    vocab_size: int = 256
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab_size, self.d_model, embedding_init=logical(_normal, (VOCAB, EMBED)),
                         name="wte")
        pos = self.param("wpe", logical(_normal, (SEQ, EMBED)), (self.seq_len, self.d_model))
        x = (embed(tokens) + pos[: tokens.shape[1]]).astype(self.dtype)
        for _ in range(self.num_layers):
            x = DecoderBlock(self.num_heads, self.dtype)(x)
        x = _layer_norm(self.dtype)(x)
        return embed.attend(x.astype(jnp.float32))  # tied output embedding
