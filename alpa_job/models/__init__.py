"""Models by name, each with its loss: `get_model(config)` -> `ModelSpec`.

A model module only names logical axes (models/axes.py); which mesh axis splits them is the
engine's business.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict

from alpa_job.errors import KitError


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    module: Any  # a flax.linen.Module
    input_key: str  # the batch field the module reads
    has_batch_stats: bool  # BatchNorm running statistics live beside params
    loss: Callable  # loss(outputs, batch) -> per-example loss, shape [batch]

    def apply_train(self, variables: Dict[str, Any], batch: Dict[str, Any]):
        """Forward pass in training mode; returns (outputs, new batch_stats or None)."""
        if self.has_batch_stats:
            out, updates = self.module.apply(variables, batch[self.input_key], train=True,
                                             mutable=["batch_stats"])
            return out, updates["batch_stats"]
        return self.module.apply(variables, batch[self.input_key]), None

    def masked_loss(self, params, batch_stats, batch: Dict[str, Any]):
        """Mean loss over the real rows of a fixed-shape batch; returns (loss, new batch_stats).

        Padded rows (mask 0) carry no weight, so a padded last batch trains like a short one.
        Both engines differentiate this same function.
        """
        import jax.numpy as jnp

        variables = {"params": params}
        if self.has_batch_stats:
            variables["batch_stats"] = batch_stats
        outputs, new_stats = self.apply_train(variables, batch)
        per_example = self.loss(outputs, batch).astype(jnp.float32)
        mask = batch["mask"]
        return (per_example * mask).sum() / jnp.maximum(mask.sum(), 1.0), new_stats


def _mse(outputs, batch):
    return ((outputs - batch["y"]) ** 2).mean(axis=-1)


def _cross_entropy(logits, labels):
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


def _classification_loss(logits, batch):
    return _cross_entropy(logits, batch["label"])


def _next_token_loss(logits, batch):
    return _cross_entropy(logits, batch["tokens"][:, 1:]).mean(axis=-1)


def get_model(config) -> ModelSpec:
    import jax.numpy as jnp

    dtype = jnp.bfloat16 if config.dtype == "bfloat16" else jnp.float32
    if config.model == "mlp":
        from alpa_job.models.mlp import MLPModel

        return ModelSpec("mlp", MLPModel(config.hidden_dim, dtype), "x", False, _mse)
    if config.model == "wide_resnet":
        from alpa_job.models.wide_resnet import WideResNet

        return ModelSpec("wide_resnet", WideResNet(config.depth, config.width, 10, dtype), "image", True,
                         _classification_loss)
    if config.model == "gpt":
        from alpa_job.models.gpt import GPT

        module = GPT(config.num_layers, config.d_model, config.num_heads, config.seq_len, config.vocab_size, dtype)
        return ModelSpec("gpt", _InputsOnly(module), "tokens", False, _next_token_loss)
    raise KitError(f"--model {config.model!r} is not known; use one of: mlp, wide_resnet, gpt")


class _InputsOnly:
    """GPT reads tokens[:, :-1] and predicts tokens[:, 1:]; the batch holds seq_len + 1 tokens."""

    def __init__(self, module):
        self.module = module

    def init(self, rngs, tokens, **kwargs):
        return self.module.init(rngs, tokens[:, :-1], **kwargs)

    def apply(self, variables, tokens, **kwargs):
        return self.module.apply(variables, tokens[:, :-1], **kwargs)
