"""What a plan reads of a job's settings and the cost models it can rank with: the names the `plan` command's
flags are made from, apart from the planner itself, so that building the CLI's parser (every command, `train`
included) does not import the planner."""

from __future__ import annotations

COST_MODELS = ("auto", "kernels", "flops")
MODEL_SETTINGS = ("model", "model_args", "batch_size", "dtype", "micro_batches", "pipeline_repeats", "fsdp_gather")
