"""GPT's settings: what `--model gpt` reads, declared without flax so `--help` and the checks before
Ray never import jax (the model itself is gpt.py)."""

from __future__ import annotations

from alpa_job.errors import KitError
from alpa_job.setting import POSITIVE, Setting

# The batch field the model reads: the checks before Ray match a dataset against it without building it.
INPUT_FIELD = "tokens"

REMAT_POLICIES = ("none", "mlp-weights", "weights", "dots", "full")

SETTINGS = (
    Setting("num_layers", int, 2, "transformer blocks", check=POSITIVE),
    Setting("d_model", int, 128, "embedding width", check=POSITIVE),
    Setting("num_heads", int, 4, "attention heads (divide --d-model)", check=POSITIVE),
    Setting("seq_len", int, 64, "tokens per sequence", check=POSITIVE),
    Setting("vocab_size", int, 256, "vocabulary", check=POSITIVE),
    Setting(
        "remat",
        str,
        "none",
        "recompute in the backward pass instead of keeping: none; mlp-weights (keep "
        "every activation, recompute only the MLP weights' bf16 copies: under fsdp they are gathered again "
        "instead of all held at once); weights (the same for every weight); dots (keep the matmuls' and "
        "attention's outputs, recompute the rest; under fsdp the weights are gathered again too); full "
        "(keep only each block's input)",
        choices=REMAT_POLICIES,
    ),
)


def check(args) -> None:
    """Heads split the embedding evenly."""
    if args.d_model % args.num_heads != 0:
        raise KitError(f"--d-model {args.d_model} is not divisible by --num-heads {args.num_heads}; use a multiple of {args.num_heads}")
