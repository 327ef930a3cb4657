"""WideResNet's settings: what `--model wide_resnet` reads, declared without flax so `--help` and the
checks before Ray never import jax (the model itself is wide_resnet.py)."""

from __future__ import annotations

from alpa_job.errors import KitError
from alpa_job.setting import POSITIVE, Setting

# The batch field the model reads: the checks before Ray match a dataset against it without building it.
INPUT_FIELD = "image"

SETTINGS = (
    Setting("depth", int, 10, "6n+4"),  # 10: one block per stage; the bound is check()'s
    Setting("width", int, 2, "widening factor k", check=POSITIVE),
)


def check(args) -> None:
    """A depth the network cannot be built with (3 stages of n blocks of 2 convolutions, plus 4)."""
    if (args.depth - 4) % 6 != 0 or args.depth < 10:
        raise KitError(f"--depth {args.depth} is not a WideResNet depth; use 6n+4 with n >= 1 (10, 16, 22, 28)")
