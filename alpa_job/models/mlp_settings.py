"""The MLP's settings: what `--model mlp` reads, declared without flax so `--help` and the checks
before Ray never import jax (the model itself is mlp.py)."""

from __future__ import annotations

from alpa_job.setting import POSITIVE, Setting

# The batch field the model reads: the checks before Ray match a dataset against it without building it.
INPUT_FIELD = "x"

SETTINGS = (
    # The pipeshard tutorial's `dim`.
    Setting("hidden_dim", int, 256, "width (layers 4h -> h -> 4h -> h)", check=POSITIVE),
)
