"""ResNet with bottleneck blocks (ResNet-50 is stages of 3, 4, 6, 3 blocks) for CIFAR-10 shapes, in
plain Flax: a 3x3 stem without max-pooling (32x32 images are small already), BatchNorm after every
convolution, global average pooling and a dense classifier.

Every parameter carries logical axis names (`channels`, `conv_in`, `embed`): the names the kit's
sharding rules know (`alpa_job.api` exports the same strings as CHANNELS, CONV_IN, EMBED), so
`fsdp` and `tensor` split the convolutions' channels. This module needs only jax and flax;
`model.py` turns it into the kit's model spec.
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

import flax.linen as nn
import jax.numpy as jnp

CHANNELS, CONV_IN, EMBED = "channels", "conv_in", "embed"

EXPANSION = 4  # a bottleneck block's output has 4x its inner width


def logical(init: Callable, axes: Tuple[Any, ...]) -> Callable:
    """The initializer with its logical axis names attached (flax's own mechanism; a flax too old to
    have it gets the bare initializer, and the Alpa engine plans the sharding itself)."""
    with_partitioning = getattr(nn, "with_logical_partitioning", None)
    return init if with_partitioning is None else with_partitioning(init, axes)


def conv(features: int, kernel: int, strides: int, dtype: Any, name: str) -> nn.Conv:
    return nn.Conv(
        features,
        (kernel, kernel),
        strides=(strides, strides),
        padding="SAME",
        use_bias=False,
        dtype=dtype,
        name=name,
        # The window dims are never split.
        kernel_init=logical(nn.initializers.kaiming_normal(), (None, None, CONV_IN, CHANNELS)),
    )


def batch_norm(train: bool, dtype: Any, name: str) -> nn.BatchNorm:
    return nn.BatchNorm(
        use_running_average=not train,
        momentum=0.9,
        epsilon=1e-5,
        dtype=dtype,
        name=name,
        scale_init=logical(nn.initializers.ones, (CHANNELS,)),
        bias_init=logical(nn.initializers.zeros, (CHANNELS,)),
    )


class Bottleneck(nn.Module):
    """1x1 down to `features`, 3x3 (carrying the stride), 1x1 up to 4 x `features`, plus the shortcut
    (a strided 1x1 projection where the shape changes)."""

    features: int
    strides: int = 1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool):
        out_features = self.features * EXPANSION
        y = nn.relu(batch_norm(train, self.dtype, "bn1")(conv(self.features, 1, 1, self.dtype, "conv1")(x)))
        y = nn.relu(batch_norm(train, self.dtype, "bn2")(conv(self.features, 3, self.strides, self.dtype, "conv2")(y)))
        y = batch_norm(train, self.dtype, "bn3")(conv(out_features, 1, 1, self.dtype, "conv3")(y))
        shortcut = x
        if self.strides != 1 or x.shape[-1] != out_features:
            shortcut = conv(out_features, 1, self.strides, self.dtype, "shortcut")(x)
            shortcut = batch_norm(train, self.dtype, "shortcut_bn")(shortcut)
        return nn.relu(y + shortcut)


class ResNet(nn.Module):
    """images [batch, 32, 32, 3] -> logits [batch, num_classes]; stage i has width base_width x 2^i."""

    stage_sizes: Tuple[int, ...] = (3, 4, 6, 3)
    base_width: int = 64
    num_classes: int = 10
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = x.astype(self.dtype)
        x = nn.relu(batch_norm(train, self.dtype, "stem_bn")(conv(self.base_width, 3, 1, self.dtype, "stem")(x)))
        for stage, blocks in enumerate(self.stage_sizes):
            for block in range(blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = Bottleneck(self.base_width * 2**stage, strides, self.dtype, name=f"stage{stage + 1}_block{block + 1}")(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(
            self.num_classes,
            dtype=self.dtype,
            name="classifier",
            # 10 classes: no device count divides them, so the class dim stays whole.
            kernel_init=logical(nn.initializers.lecun_normal(), (EMBED, None)),
            bias_init=logical(nn.initializers.zeros, (None,)),
        )(x)
