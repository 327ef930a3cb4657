"""The pipeshard tutorial's MLP: Dense 4h -> h -> 4h -> h, relu after each."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from alpa_job import api
from alpa_job.models.mlp_settings import INPUT_FIELD
from alpa_job.api import EMBED, MLP, logical


class MLPModel(nn.Module):
    hidden_dim: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        # Alternating up/down projections: Megatron-style tensor parallelism splits the 4h
        # dimension (column-parallel up, row-parallel down), so only one all-reduce per pair.
        for width, axes in ((4 * self.hidden_dim, (EMBED, MLP)), (self.hidden_dim, (MLP, EMBED))) * 2:
            x = nn.Dense(
                width,
                dtype=self.dtype,
                kernel_init=logical(nn.initializers.lecun_normal(), axes),
                bias_init=logical(nn.initializers.zeros, (axes[1],)),
            )(x)
            x = nn.relu(x)
        return x


def synthetic(args, rng, n):
    """The pipeshard tutorial's data: y = x W + b + 0.1 noise."""
    dim = args.hidden_dim
    w = rng.normal(size=(dim, dim)).astype(np.float32) / np.sqrt(dim)
    b = rng.normal(size=(dim,)).astype(np.float32)
    x = rng.normal(size=(n, dim)).astype(np.float32)
    y = x @ w + b + 0.1 * rng.normal(size=(n, dim)).astype(np.float32)
    return {"x": x, "y": y.astype(np.float32)}


def build(args, dtype) -> api.Model:
    """The built-in MLP through the public API (alpa_job/api.py), like any model a user brings."""
    return api.Model(
        MLPModel(args.hidden_dim, dtype),
        input_field=INPUT_FIELD,
        loss=api.mse,
        synthetic=synthetic,
        layer_count=4,  # Dense 4h -> h -> 4h -> h
        layer_class=nn.Dense,
    )
