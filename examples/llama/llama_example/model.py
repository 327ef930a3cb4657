"""The LLaMA-style decoder as a model the kit trains: `--model llama_example.model:build`.

`LlamaArgs` declares the model's settings (each field is a `--model-arg NAME=VALUE`, typed by its
hint); `build` returns the kit's model spec: the Flax module, the batch field it reads, the
per-example loss and learnable synthetic data.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from alpa_job import api
from llama_example.hf import hf_weights
from llama_example.layers import REMAT_POLICIES, DecoderBlock, Llama, RopeScaling, decoder_block

ROPE_SCALINGS = ("none", "llama3")


@dataclasses.dataclass
class LlamaArgs:
    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2  # must divide num_heads; equal to it is plain multi-head attention
    mlp_dim: int = 0  # 0: 8/3 x d_model rounded up to a multiple of 16 (SwiGLU's usual size)
    seq_len: int = 32  # tokens per synthetic sequence
    vocab_size: int = 256
    rope_theta: float = 10000.0
    attention: str = "auto"  # auto | cudnn | einsum
    rms_norm_eps: float = 1e-6  # every RMSNorm's epsilon; Hugging Face's Llama 2 and 3 checkpoints use 1e-5
    rope_scaling: str = "none"  # none | llama3 (Llama 3.1's frequency scaling, with the four rope_* below)
    rope_factor: float = 8.0  # llama3: long wavelengths' frequencies are divided by it
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths over rope_original_max_len / this are scaled fully
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths under rope_original_max_len / this are kept
    rope_original_max_len: int = 8192  # llama3: the context length the model was first trained on
    tie_embeddings: bool = False  # true: no lm_head, the logits are x @ embedding.T (Llama 3.2 1B/3B)
    remat: str = "none"  # none | dots (keep only the weight products) | full (keep each block's input)


def mlp_dim_of(args: LlamaArgs) -> int:
    """The feed-forward inner width: as set, or 8/3 x d_model rounded up to a multiple of 16."""
    return args.mlp_dim or -(-8 * args.d_model // 48) * 16


def check(args: LlamaArgs) -> None:
    """Sizes the decoder cannot be built with, as one line naming the fix."""
    if args.remat not in REMAT_POLICIES:
        raise ValueError(f"remat={args.remat!r} is not known; use one of: {', '.join(REMAT_POLICIES)}")
    if args.num_heads % args.num_kv_heads:
        raise ValueError(f"num_kv_heads={args.num_kv_heads} does not divide num_heads={args.num_heads}; use a divisor of {args.num_heads}")
    if args.d_model % args.num_heads or (args.d_model // args.num_heads) % 2:
        raise ValueError(
            f"d_model={args.d_model} must be num_heads={args.num_heads} x an even head size "
            "(rotary embeddings turn pairs); e.g. d_model=" + str(args.num_heads * 16)
        )
    if args.attention not in ("auto", "cudnn", "einsum"):
        raise ValueError(f"attention={args.attention!r} is not known; use auto, cudnn or einsum")
    check_rope(args)


def check_rope(args: LlamaArgs) -> None:
    """The rope scaling settings, checked whether or not rope_scaling uses them (a wrong one is a
    mistake either way, and caught before it is switched on)."""
    if args.rope_scaling not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling={args.rope_scaling!r} is not known; use none or llama3")
    if args.rope_low_freq_factor >= args.rope_high_freq_factor:
        raise ValueError(
            f"rope_low_freq_factor={args.rope_low_freq_factor} must be below rope_high_freq_factor="
            f"{args.rope_high_freq_factor}; e.g. rope_low_freq_factor=1 rope_high_freq_factor=4"
        )
    if args.rope_factor <= 0 or args.rope_original_max_len <= 0:
        raise ValueError(
            f"rope_factor={args.rope_factor} and rope_original_max_len={args.rope_original_max_len} "
            "must be > 0; e.g. rope_factor=8 rope_original_max_len=8192"
        )


def rope_scaling_of(args: LlamaArgs) -> Optional[RopeScaling]:
    """The layers' RopeScaling for args.rope_scaling (None: plain theta^(-2i/d) frequencies)."""
    if args.rope_scaling == "none":
        return None
    return RopeScaling(
        factor=args.rope_factor,
        low_freq_factor=args.rope_low_freq_factor,
        high_freq_factor=args.rope_high_freq_factor,
        original_max_len=args.rope_original_max_len,
    )


def next_token_loss(logits, batch):
    """Per-sequence mean cross-entropy of predicting token t+1 from tokens 0..t."""
    return api.cross_entropy(logits, batch["tokens"][:, 1:]).mean(axis=-1)


def synthetic(args: LlamaArgs, rng: np.random.Generator, n: int):
    """Each sequence is an arithmetic progression modulo the vocabulary (seq_len + 1 tokens): the next token
    follows from the two before it, so the loss falls within a few steps."""
    start = rng.integers(0, args.vocab_size, size=(n, 1))
    stride = rng.integers(1, 4, size=(n, 1))
    tokens = (start + stride * np.arange(args.seq_len + 1)[None, :]) % args.vocab_size
    return {"tokens": tokens.astype(np.int32)}


def repeated_blocks(module: Llama, tokens) -> api.RepeatedBlocks:
    """The shell (embedding, final norm, head: a Llama of 0 layers names them alike) plus num_layers
    DecoderBlocks, each called on [batch, seq_len, d_model] activations: the fast initialiser makes one
    block once, and --strategy pipeline cuts the model between blocks."""
    import jax

    return api.RepeatedBlocks(
        shell=api.NextTokenInputs(module.clone(num_layers=0)),  # clone keeps every other field: eps, tying, rope
        block=decoder_block(module),
        block_input=jax.ShapeDtypeStruct((tokens.shape[0], tokens.shape[1] - 1, module.d_model), module.dtype),
        names=tuple(f"layer_{i}" for i in range(module.num_layers)),
    )


def build(args: LlamaArgs, dtype) -> api.Model:
    check(args)
    module = Llama(
        num_layers=args.num_layers,
        d_model=args.d_model,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        mlp_dim=mlp_dim_of(args),
        vocab_size=args.vocab_size,
        dtype=dtype,
        rope_theta=args.rope_theta,
        attention=args.attention,
        rope_scaling=rope_scaling_of(args),
        rms_norm_eps=args.rms_norm_eps,
        tie_embeddings=args.tie_embeddings,
        remat=args.remat,
    )
    return api.Model(
        module=api.NextTokenInputs(module),
        input_field="tokens",
        loss=next_token_loss,
        synthetic=synthetic,
        repeated_blocks=lambda tokens: repeated_blocks(module, tokens),
        layer_count=args.num_layers,
        layer_class=DecoderBlock,
        depth_setting="num_layers",
        hf=hf_weights(args, mlp_dim_of(args)),
        causal_attention=True,
    )  # API 1.5: the report's MFU counts its attention at half, as MaxText
