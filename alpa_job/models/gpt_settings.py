"""GPT's settings: what `--model gpt` reads, declared without flax so `--help` and the checks before
Ray never import jax (the model itself is gpt.py)."""
from __future__ import annotations

from alpa_job.errors import KitError
from alpa_job.settings.setting import POSITIVE, Setting

# The batch field the model reads: the checks before Ray match a dataset against it without building it.
INPUT_FIELD = "tokens"

REMAT_POLICIES = ("none", "weights", "dots", "full")

SETTINGS = (
    Setting("num_layers", int, 2, "transformer blocks", check=POSITIVE),
    Setting("d_model", int, 128, "embedding width", check=POSITIVE),
    Setting("num_heads", int, 4, "attention heads (divide --d-model)", check=POSITIVE),
    Setting("seq_len", int, 64, "tokens per sequence", check=POSITIVE),
    Setting("vocab_size", int, 256, "vocabulary", check=POSITIVE),
    Setting("remat", str, "none", "recompute each block's activations in the backward pass instead of keeping "
            "them: none, weights (keep every activation, recompute only the bf16 copies of the weights: under fsdp "
            "they are gathered again in the backward instead of held), dots (keep the matmuls' and attention's outputs, recompute the rest; under fsdp the "
            "parameters are gathered again) or full (keep only each block's input)", choices=REMAT_POLICIES),
    Setting("batch_chunks", int, 1, "run the blocks on this many slices of each batch side by side, so that under "
            "--strategy tensor one slice's all-reduces overlap another's matmuls (2 is the usual choice there; it "
            "must divide the batch on each device)", check=POSITIVE),
)


def check(config) -> None:
    """Heads split the embedding evenly; the batch splits into --batch-chunks slices."""
    if config.d_model % config.num_heads != 0:
        raise KitError(f"--d-model {config.d_model} is not divisible by --num-heads {config.num_heads}; "
                       f"use a multiple of {config.num_heads}")
    batch = getattr(config, "batch_size", None)
    if batch and batch % config.batch_chunks != 0:
        raise KitError(f"--batch-chunks {config.batch_chunks} does not divide --batch-size {batch}; "
                       f"use a divisor of {batch} (1 turns chunking off)")
