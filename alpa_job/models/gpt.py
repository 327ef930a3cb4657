"""A decoder-only transformer (GPT-style): pre-LayerNorm, causal self-attention, GELU MLP."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

try:
    from flax.linen import dtypes as flax_dtypes
except ImportError:  # flax 0.6.2 (the Alpa image), where dense_options refuses `weights`
    flax_dtypes = None

from alpa_job import api
from alpa_job.errors import KitError
from alpa_job.models.gpt_settings import INPUT_FIELD
from alpa_job.api import BATCH, EMBED, HEADS, KV, MLP, SEQ, VOCAB, RepeatedBlocks, constrain, cross_entropy, logical

_normal = nn.initializers.normal(stddev=0.02)


def _layer_norm(dtype: Any) -> nn.LayerNorm:
    return nn.LayerNorm(
        dtype=dtype,
        scale_init=logical(nn.initializers.ones, (EMBED,)),
        bias_init=logical(nn.initializers.zeros, (EMBED,)),
    )


def causal_attention(q, k, v, implementation: str = "auto"):
    """Causal softmax attention over [batch, seq, heads, head_dim].

    "auto": cuDNN's fused flash attention on a GPU in bf16/fp16 (on a Hopper GPU it is clearly the
    fastest of the three forms: faster than the einsum form, and jax's generic XLA
    dot_product_attention is slower than both), the plain einsum form everywhere else, including
    the Alpa image's jax 0.3.22, which has no dot_product_attention at all.
    """
    fused = getattr(jax.nn, "dot_product_attention", None)
    wants_cudnn = implementation == "cudnn" or (
        implementation == "auto" and fused is not None and jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
    )
    if wants_cudnn:
        return fused(q, k, v, is_causal=True, implementation="cudnn")
    seq, head_dim = q.shape[1], q.shape[-1]
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(q.dtype)
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class CausalSelfAttention(nn.Module):
    num_heads: int
    dtype: Any = jnp.float32
    attention: str = "auto"  # "auto" | "cudnn" | "einsum" (see causal_attention)
    remat: str = "none"  # only `weights` changes anything here (dense_options)

    @nn.compact
    def __call__(self, x):
        d_model = x.shape[-1]
        head_dim = d_model // self.num_heads
        qkv = nn.DenseGeneral(
            (3, self.num_heads, head_dim),
            dtype=self.dtype,
            name="qkv",
            **dense_options(self.remat),
            kernel_init=logical(_normal, (EMBED, None, HEADS, KV)),
            bias_init=logical(nn.initializers.zeros, (None, HEADS, KV)),
        )(x)
        qkv = constrain(qkv, (BATCH, None, None, HEADS, KV))
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        out = constrain(causal_attention(q, k, v, self.attention), (BATCH, None, HEADS, KV))
        out = _name_for_remat(out, "attention")
        return nn.DenseGeneral(
            d_model,
            axis=(-2, -1),
            dtype=self.dtype,
            name="out",
            **dense_options(self.remat),
            kernel_init=logical(_normal, (HEADS, KV, EMBED)),
            bias_init=logical(nn.initializers.zeros, (EMBED,)),
        )(out)


def _name_for_remat(x, name: str):
    """Tag `x` so the `dots` remat policy keeps it (jax without checkpoint_name: unchanged)."""
    try:
        from jax.ad_checkpoint import checkpoint_name  # a submodule: not an attribute of `jax` until imported
    except ImportError:
        return x
    return checkpoint_name(x, name)


def block_class(remat: str):
    """DecoderBlock, or DecoderBlock under jax.checkpoint with the `remat` policy (gpt_settings.REMAT_POLICIES).

    `dots` keeps every matmul's output and the attention's (its fused kernel is the costliest to
    rerun) and recomputes the norms, GELU and residual adds; under fsdp the weights a block uses
    are then gathered again in the backward instead of held from the forward. `full` keeps only
    each block's input. `weights` and `mlp-weights` are no checkpoint of the block: its dense layers
    recompute their weights' compute-dtype copies (dense_options)."""
    if remat in ("none", "weights", "mlp-weights"):
        return DecoderBlock
    policies = jax.checkpoint_policies
    if remat == "dots":
        both = getattr(policies, "save_from_both_policies", None)
        names = getattr(policies, "save_only_these_names", None)
        policy = both(policies.checkpoint_dots, names("attention")) if both and names else policies.checkpoint_dots
    else:
        policy = policies.nothing_saveable
    return nn.remat(DecoderBlock, policy=policy)


def dense_options(remat: str, mlp: bool = False) -> dict:
    """Extra dense-layer arguments for `remat` (`mlp`: for the MLP's two layers). `weights` (every dense
    layer) and `mlp-weights` (the MLP's, two thirds of a block's weights): the kernel stays fp32 up to
    the matmul, which casts it inside a checkpoint that keeps nothing, so the backward casts (under
    fsdp: gathers) the weight again instead of holding its compute-dtype copy from the forward (under
    fsdp every block's gathered weights at once); every activation is kept, nothing else is recomputed."""
    if not (remat == "weights" or (remat == "mlp-weights" and mlp)):
        # api.dot_general: the product --precision fp8 runs in fp8 (a flax without the hook: plain products).
        return {"dot_general": api.dot_general} if "dot_general" in getattr(nn.Dense, "__dataclass_fields__", {}) else {}
    if "promote_dtype" not in getattr(nn.Dense, "__dataclass_fields__", {}):
        raise KitError(f"--remat {remat} needs flax 0.8 or later (dense layers without a promote_dtype hook); use --remat dots or full")
    return {"promote_dtype": _promote_all_but_the_kernel, "dot_general": _dot_casting_the_kernel_again}


def _promote_all_but_the_kernel(inputs, kernel, bias, dtype=None, inexact=True):
    inputs, _, bias = flax_dtypes.promote_dtype(inputs, kernel, bias, dtype=dtype, inexact=inexact)
    return inputs, kernel, bias


def _dot_casting_the_kernel_again(inputs, kernel, dimension_numbers, precision=None, **kwargs):
    def dot(x, k):
        return api.dot_general(x, k.astype(x.dtype), dimension_numbers, precision=precision, **kwargs)

    # The backward needs only x and the cast kernel: the rerun matmul is dead and dropped.
    return jax.checkpoint(dot, policy=jax.checkpoint_policies.nothing_saveable)(inputs, kernel)


class DecoderBlock(nn.Module):
    num_heads: int
    dtype: Any = jnp.float32
    attention: str = "auto"
    remat: str = "none"

    @nn.compact
    def __call__(self, x):
        x = x + CausalSelfAttention(self.num_heads, self.dtype, self.attention, self.remat)(
            constrain(_layer_norm(self.dtype)(x), (BATCH, SEQ, EMBED))
        )
        d_model = x.shape[-1]
        y = nn.Dense(
            4 * d_model,
            dtype=self.dtype,
            **dense_options(self.remat, mlp=True),
            kernel_init=logical(_normal, (EMBED, MLP)),
            bias_init=logical(nn.initializers.zeros, (MLP,)),
        )(constrain(_layer_norm(self.dtype)(x), (BATCH, SEQ, EMBED)))
        y = nn.gelu(constrain(y, (BATCH, SEQ, MLP)))
        y = nn.Dense(
            d_model,
            dtype=self.dtype,
            **dense_options(self.remat, mlp=True),
            kernel_init=logical(_normal, (MLP, EMBED)),
            bias_init=logical(nn.initializers.zeros, (EMBED,)),
        )(y)
        return constrain(x + y, (BATCH, SEQ, EMBED))


class GPT(nn.Module):
    num_layers: int = 2
    d_model: int = 128
    num_heads: int = 4
    seq_len: int = 64
    vocab_size: int = 256
    dtype: Any = jnp.float32
    attention: str = "auto"
    remat: str = "none"  # gpt_settings.REMAT_POLICIES

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab_size, self.d_model, embedding_init=logical(_normal, (VOCAB, EMBED)), name="wte")
        pos = self.param("wpe", logical(_normal, (SEQ, EMBED)), (self.seq_len, self.d_model))
        x = constrain((embed(tokens) + pos[: tokens.shape[1]]).astype(self.dtype), (BATCH, SEQ, EMBED))
        block = block_class(self.remat)
        for i in range(self.num_layers):  # named as without remat: checkpoints and the initialiser see one tree
            x = block(self.num_heads, self.dtype, self.attention, self.remat, name=f"DecoderBlock_{i}")(x)
        x = _layer_norm(self.dtype)(x)
        return constrain(tied_logits(x, embed.embedding, self.dtype), (BATCH, SEQ, VOCAB))


def tied_logits(x, embedding, dtype):
    """The tied output projection in the compute dtype: bf16 logits from a bf16 matmul.

    The parameters stay fp32; only the copy fed to the matmul is cast. The loss upcasts the
    logits to fp32 inside its (fused) log-softmax, so nothing of size batch x seq x vocab is
    ever held in fp32. An fp32 matmul here (`embed.attend(x.astype(float32))`) costs a large
    model step time and gigabytes of fp32 logits scratch.
    """
    return jnp.einsum("bsd,vd->bsv", x.astype(dtype), embedding.astype(dtype))


def _next_token_loss(logits, batch):
    return cross_entropy(logits, batch["tokens"][:, 1:]).mean(axis=-1)


def repeated_blocks(model: api.NextTokenInputs, tokens) -> RepeatedBlocks:
    """The shell (embeddings, final LayerNorm: a GPT of 0 layers names them alike) plus num_layers
    DecoderBlocks, each called on the [batch, seq_len, d_model] activations."""
    gpt = model.module
    return RepeatedBlocks(
        shell=api.NextTokenInputs(gpt.clone(num_layers=0)),
        block=DecoderBlock(gpt.num_heads, gpt.dtype, gpt.attention, gpt.remat),
        block_input=jax.ShapeDtypeStruct((tokens.shape[0], tokens.shape[1] - 1, gpt.d_model), gpt.dtype),
        names=tuple(f"DecoderBlock_{i}" for i in range(gpt.num_layers)),
    )


def synthetic(args, rng, n):
    """Each sequence is an arithmetic progression modulo the vocabulary (learnable); seq_len + 1 tokens."""
    vocab, seq = args.vocab_size, args.seq_len + 1
    start = rng.integers(0, vocab, size=(n, 1))
    stride = rng.integers(1, 4, size=(n, 1))
    tokens = (start + stride * np.arange(seq)[None, :]) % vocab
    return {"tokens": tokens.astype(np.int32)}


def build(args, dtype) -> api.Model:
    """The built-in GPT through the public API (alpa_job/api.py), its identical blocks declared for the
    fast initialiser."""
    module = api.NextTokenInputs(
        GPT(args.num_layers, args.d_model, args.num_heads, args.seq_len, args.vocab_size, dtype, remat=getattr(args, "remat", "none"))
    )
    return api.Model(
        module,
        input_field=INPUT_FIELD,
        loss=_next_token_loss,
        synthetic=synthetic,
        repeated_blocks=lambda tokens: repeated_blocks(module, tokens),
        layer_count=args.num_layers,
        layer_class=DecoderBlock,
        depth_setting="num_layers",
        causal_attention=True,
    )
