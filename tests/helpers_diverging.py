"""A model whose loss becomes NaN after a number of steps, the same on every machine: a scalar `t` that
Adam moves by about the learning rate each step (its gradient is a constant), and a loss that is NaN
once `t` passes `limit`. `--model helpers_diverging:build` (tests/ on PYTHONPATH)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from alpa_job import api


class Drift(nn.Module):
    width: int
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.zeros, (self.width,))
        t = self.param("t", nn.initializers.zeros, ())
        return jnp.concatenate([x * w, jnp.broadcast_to(t, x.shape[:-1] + (1,))], axis=-1)


def synthetic(args, rng, n):
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return {"x": x, "y": 0.5 * x}


def build(*, dtype, limit: float = 3.0):
    def loss(out, batch):
        t = out[..., -1]
        # -1e-3 * t: a constant gradient, so Adam moves t up by ~lr a step, whatever the data.
        return api.mse(out[..., :-1], batch) - 1e-3 * t + jnp.where(t > limit, jnp.nan, 0.0)

    return api.Model(Drift(8, dtype), input_field="x", loss=loss, synthetic=synthetic)
