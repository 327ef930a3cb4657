"""WideResNet for CIFAR-10 shapes (32x32x3, 10 classes), with BatchNorm batch_stats.

depth = 6n + 4 (n blocks per stage, 3 stages), width = widening factor k.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from alpa_job import api
from alpa_job.models.wide_resnet_settings import INPUT_FIELD
from alpa_job.api import CHANNELS, CONV_IN, EMBED, logical


def _conv(features: int, strides: int, dtype: Any, name: str = None) -> nn.Conv:
    return nn.Conv(
        features,
        (3, 3),
        strides=(strides, strides),
        padding="SAME",
        use_bias=False,
        dtype=dtype,
        # The 3x3 window dims are never split.
        kernel_init=logical(nn.initializers.kaiming_normal(), (None, None, CONV_IN, CHANNELS)),
        name=name,
    )


def _norm(train: bool, dtype: Any) -> nn.BatchNorm:
    return nn.BatchNorm(
        use_running_average=not train,
        momentum=0.9,
        epsilon=1e-5,
        dtype=dtype,
        scale_init=logical(nn.initializers.ones, (CHANNELS,)),
        bias_init=logical(nn.initializers.zeros, (CHANNELS,)),
    )


class WideBlock(nn.Module):
    features: int
    strides: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool):
        y = nn.relu(_norm(train, self.dtype)(x))
        shortcut = x
        if self.strides != 1 or x.shape[-1] != self.features:
            shortcut = _conv(self.features, self.strides, self.dtype, name="shortcut")(y)
        y = _conv(self.features, self.strides, self.dtype)(y)
        y = nn.relu(_norm(train, self.dtype)(y))
        y = _conv(self.features, 1, self.dtype)(y)
        return y + shortcut


class WideResNet(nn.Module):
    depth: int = 10
    width: int = 2
    num_classes: int = 10
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        blocks_per_stage = (self.depth - 4) // 6
        x = _conv(16, 1, self.dtype, name="stem")(x)
        for stage, base in enumerate((16, 32, 64)):
            for block in range(blocks_per_stage):
                strides = 2 if stage > 0 and block == 0 else 1
                x = WideBlock(base * self.width, strides, self.dtype)(x, train)
        x = nn.relu(_norm(train, self.dtype)(x))
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(
            self.num_classes,
            dtype=self.dtype,
            # 10 classes: no device count divides them, so the class dim is never split.
            kernel_init=logical(nn.initializers.lecun_normal(), (EMBED, None)),
            bias_init=logical(nn.initializers.zeros, (None,)),
        )(x)


def _classification_loss(logits, batch):
    return api.cross_entropy(logits, batch["label"])


def synthetic(args, rng, n):
    """CIFAR-shaped images whose labels follow a fixed random projection of the image (learnable)."""
    images = rng.normal(size=(n, 32, 32, 3)).astype(np.float32)
    proj = rng.normal(size=(32 * 32 * 3, 10)).astype(np.float32)
    labels = np.argmax(images.reshape(n, -1) @ proj, axis=-1).astype(np.int32)
    return {"image": images, "label": labels}


def build(args, dtype) -> api.Model:
    """The built-in WideResNet through the public API (alpa_job/api.py): BatchNorm statistics ride beside
    the parameters."""
    return api.Model(
        WideResNet(args.depth, args.width, 10, dtype),
        input_field=INPUT_FIELD,
        loss=_classification_loss,
        batch_stats=True,
        synthetic=synthetic,
        layer_count=3 * ((args.depth - 4) // 6),  # 3 stages x n blocks
        layer_class=WideBlock,
    )
