"""A tiny Llama checkpoint in Hugging Face's PyTorch format, written without the kit: random tensors under the
names and shapes transformers' own PyTorch -> Flax converter maps onto its Flax Llama's parameters (the
converter checks them), and that model's logits as the reference."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Tuple

import numpy as np

TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
# The same shapes as the kit's LLaMA example's settings.
TINY_ARGS = (
    "num_layers=2",
    "d_model=64",
    "num_heads=4",
    "num_kv_heads=2",
    "mlp_dim=160",
    "vocab_size=128",
    "rms_norm_eps=1e-5",
    "seq_len=16",
)


def write_tiny(directory: str, files: int = 2, **overrides) -> Dict[str, np.ndarray]:
    """A tiny checkpoint of TINY's shapes (with `overrides`) in `directory`; returns its tensors."""
    tensors = pytorch_state_dict(reference_model(**overrides))
    write_checkpoint(directory, tensors, {**TINY, **overrides}, files=files)
    return tensors


def reference_model(**overrides):
    from transformers import FlaxLlamaForCausalLM, LlamaConfig
    import jax.numpy as jnp

    return FlaxLlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}), seed=0, dtype=jnp.float32, _do_init=True)


def pytorch_state_dict(model, seed: int = 1) -> Dict[str, np.ndarray]:
    """Random tensors named and shaped as PyTorch's LlamaForCausalLM keeps them ([out, in] weights)."""
    from flax.traverse_util import flatten_dict

    rng = np.random.default_rng(seed)
    out = {}
    for path, leaf in flatten_dict(model.params).items():
        shape = leaf.shape[::-1] if path[-1] == "kernel" else leaf.shape
        name = ".".join(path[:-1] + ("weight",))
        scale = 1.0 if path[-1] == "weight" else 0.05  # norms near 1, projections small
        out[name] = ((1.0 if path[-1] == "weight" else 0.0) + scale * rng.standard_normal(shape)).astype(np.float32)
    return out


def write_checkpoint(
    directory: str, tensors: Dict[str, np.ndarray], config: Dict[str, Any], files: int = 2, dtype: Any = np.float32
) -> None:
    """Tensors split over `files` safetensors files with an index, as transformers shards them."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(files):
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {n: tensors[n].astype(dtype) for n in names[i::files]}
        save_file(part, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **config}, f)


def reference_logits(model, tensors: Dict[str, np.ndarray], tokens: np.ndarray) -> Tuple[np.ndarray, Any]:
    """transformers' Flax Llama's logits with the checkpoint's tensors, loaded by transformers' converter."""
    from flax.traverse_util import flatten_dict
    from transformers.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax

    params = convert_pytorch_state_dict_to_flax(dict(tensors), model)
    got, want = flatten_dict(params), flatten_dict(model.params)
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}  # every name is transformers'
    return np.asarray(model(tokens, params=params).logits, np.float32), params
