"""ResNet-50 for CIFAR-10 shapes as a model the kit trains: `--model resnet_example.model:build`.

`ResNetArgs` declares the model's settings (each field is a `--model-arg NAME=VALUE`, typed by its
hint; `stage_sizes=1,1,1,1 base_width=8` is a tiny variant); `build` returns the kit's model spec:
the Flax module, the batch field it reads, the per-example loss, BatchNorm's running statistics
and learnable synthetic data. `--dataset cifar10` feeds it the real images and labels.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

import numpy as np

from alpa_job import api
from resnet_example.layers import Bottleneck, ResNet

IMAGE_SHAPE = (32, 32, 3)


@dataclasses.dataclass
class ResNetArgs:
    stage_sizes: str = "3,4,6,3"  # bottleneck blocks per stage: ResNet-50; "3,4,23,3" is ResNet-101
    base_width: int = 64  # the first stage's inner width; stage i has base_width x 2^i
    num_classes: int = 10


def stages_of(args: ResNetArgs) -> Tuple[int, ...]:
    try:
        stages = tuple(int(s) for s in args.stage_sizes.split(","))
    except ValueError:
        stages = ()
    if not stages or min(stages) < 1:
        raise ValueError(
            f"stage_sizes={args.stage_sizes!r} is not a list of block counts; "
            "use positive integers separated by commas, e.g. stage_sizes=3,4,6,3"
        )
    return stages


def classification_loss(logits, batch):
    """Per-example cross-entropy against batch["label"]."""
    return api.cross_entropy(logits, batch["label"])


def synthetic(args: ResNetArgs, rng: np.random.Generator, n: int):
    """CIFAR-shaped noisy images whose mean colour depends on the class (learnable). The class colours
    come from a fixed seed, so every process and every call agree on them."""
    colours = np.random.default_rng(0).normal(size=(args.num_classes, 1, 1, 3))
    labels = rng.integers(0, args.num_classes, size=n)
    images = colours[labels] + rng.normal(size=(n,) + IMAGE_SHAPE)
    return {"image": images.astype(np.float32), "label": labels.astype(np.int32)}


def build(args: ResNetArgs, dtype) -> api.Model:
    stages = stages_of(args)
    module = ResNet(stage_sizes=stages, base_width=args.base_width, num_classes=args.num_classes, dtype=dtype)
    return api.Model(
        module=module,
        input_field="image",
        loss=classification_loss,
        batch_stats=True,
        synthetic=synthetic,
        layer_count=sum(stages),
        layer_class=Bottleneck,
    )
