"""The decoder's parameters as a Hugging Face `LlamaForCausalLM` checkpoint (PyTorch's names and layouts), so
`--init-from hf:DIR` reads published Llama weights and `python -m alpa_job hf export` writes them back.

PyTorch's Linear keeps its weight [out, in]; the flax kernels here are [in, out] with the attention heads split
out (query [d_model, heads, head_dim]): transposed, then reshaped. The rotary embedding turns the pairs
(i, i + head_dim/2), Hugging Face's rotate_half convention, so q_proj and k_proj need no permutation."""

from __future__ import annotations

from typing import Any, Dict, List

from alpa_job import api

# A checkpoint's config entries -> the --model-arg that sets each (config.json is checked against them).
SETTINGS = {
    "hidden_size": "d_model",
    "intermediate_size": "mlp_dim",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "vocab_size": "vocab_size",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tie_word_embeddings": "tie_embeddings",
    "rope_scaling.rope_type": "rope_scaling",
    "rope_scaling.factor": "rope_factor",
    "rope_scaling.low_freq_factor": "rope_low_freq_factor",
    "rope_scaling.high_freq_factor": "rope_high_freq_factor",
    "rope_scaling.original_max_position_embeddings": "rope_original_max_len",
}


def config_of(args: Any, mlp_dim: int) -> Dict[str, Any]:
    """The config.json these settings are."""
    scaling = args.rope_scaling
    rope_scaling = (
        None
        if scaling == "none"
        else {
            "rope_type": scaling,
            "factor": args.rope_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_len,
        }
    )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": args.d_model,
        "intermediate_size": mlp_dim,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.d_model // args.num_heads,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.seq_len,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
    }


def tensors_of(args: Any, mlp_dim: int) -> List[api.HfTensor]:
    d, heads, kv, vocab = args.d_model, args.num_heads, args.num_kv_heads, args.vocab_size
    head_dim = d // heads
    out = [
        api.HfTensor(("embed", "embedding"), "model.embed_tokens.weight", (vocab, d)),
        api.HfTensor(("final_norm", "scale"), "model.norm.weight", (d,)),
    ]
    if not args.tie_embeddings:
        out.append(api.HfTensor(("lm_head", "kernel"), "lm_head.weight", (vocab, d), transposed=True))
    for i in range(args.num_layers):
        ours, theirs = f"layer_{i}", f"model.layers.{i}"
        out += [
            api.HfTensor(
                (ours, "attention", "query", "kernel"), f"{theirs}.self_attn.q_proj.weight", (heads * head_dim, d), transposed=True
            ),
            api.HfTensor((ours, "attention", "key", "kernel"), f"{theirs}.self_attn.k_proj.weight", (kv * head_dim, d), transposed=True),
            api.HfTensor((ours, "attention", "value", "kernel"), f"{theirs}.self_attn.v_proj.weight", (kv * head_dim, d), transposed=True),
            api.HfTensor((ours, "attention", "out", "kernel"), f"{theirs}.self_attn.o_proj.weight", (d, heads * head_dim), transposed=True),
            api.HfTensor((ours, "mlp", "gate", "kernel"), f"{theirs}.mlp.gate_proj.weight", (mlp_dim, d), transposed=True),
            api.HfTensor((ours, "mlp", "up", "kernel"), f"{theirs}.mlp.up_proj.weight", (mlp_dim, d), transposed=True),
            api.HfTensor((ours, "mlp", "down", "kernel"), f"{theirs}.mlp.down_proj.weight", (d, mlp_dim), transposed=True),
            api.HfTensor((ours, "attention_norm", "scale"), f"{theirs}.input_layernorm.weight", (d,)),
            api.HfTensor((ours, "mlp_norm", "scale"), f"{theirs}.post_attention_layernorm.weight", (d,)),
        ]
    return out


def hf_weights(args: Any, mlp_dim: int) -> api.HfWeights:
    return api.HfWeights(
        architectures=("LlamaForCausalLM",), config=config_of(args, mlp_dim), settings=SETTINGS, tensors=tuple(tensors_of(args, mlp_dim))
    )
