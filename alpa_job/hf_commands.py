"""`python -m alpa_job hf export RUN DIR` and `hf logits DIR --tokens FILE.npy --out FILE.npy`.

export: a run's checkpoint (the newest complete one, or --step) written as a Hugging Face checkpoint of its
model's architecture, one parameter group restored at a time (the optimizer state is never read); a pipelined
run's stacked blocks are written back as the model's layers.
logits: the kit's float32 logits for given token ids, from a checkpoint folder, so a user can compare the kit's
reading of a checkpoint with their own reference implementation's.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from alpa_job.errors import EXIT_OK, KitError
from alpa_job.hf import layout
from alpa_job.hf.checkpoint import HfCheckpoint, write_checkpoint

EXPORT_DTYPES = ("bfloat16", "float32", "float16")


def _job_config(values: Dict[str, Any]):
    from alpa_job.settings import config as config_lib

    from alpa_job.models import size_names

    sizes = size_names()  # a run written before they moved into model_args
    known = {k: v for k, v in values.items() if k in config_lib.FIELD_NAMES}
    return config_lib.build_config(known, {}, {k: v for k, v in values.items() if k in sizes})


def run_config(run: str):
    """The JobConfig of the run that wrote `run`."""
    from alpa_job.train.rundir import saved_config

    saved = saved_config(run) if os.path.isdir(run) else None
    if saved is None:
        raise KitError(f"hf export: {run} is not a run folder (no run.json or report.json); pass the --out of a train run")
    return _job_config(saved)


def export(run: str, directory: str, dtype: str = "bfloat16", step: Optional[int] = None) -> Tuple[int, List[str]]:
    """(the step exported, the files written)."""
    from alpa_job.models import build_model
    from alpa_job.train.checkpoint_files import latest_complete_step
    from alpa_job.train.rundir import checkpoint_dir

    config = run_config(run)
    model, _ = build_model(config)
    weights = layout.weights_of(model, config.model, flag="hf export")
    folder = checkpoint_dir(run)
    step = step if step is not None else latest_complete_step(folder) if os.path.isdir(folder) else None
    state_dir = os.path.join(folder, str(step), "state") if step is not None else ""
    if not os.path.isdir(state_dir):
        raise KitError(
            f"hf export: {run} has no complete checkpoint"
            + (f" at step {step}" if step else "")
            + "; train it with --checkpoint-every N (or pick a --step that is in its checkpoints)"
        )
    files = write_checkpoint(directory, weights.config, _tensors(state_dir, weights, config), np.dtype(_np(dtype)))
    return step, files


def _np(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return dtype


def _tensors(state_dir: str, weights: Any, config) -> Iterator[Tuple[str, np.ndarray]]:
    """(name, whole tensor) in the declaration's order, restoring one top-level parameter group at a time. A
    pipelined run saved its blocks stacked under one group: a parameter group the checkpoint does not have is
    a block, the next of that stack (the declaration lists the blocks in the model's order)."""
    from alpa_job.engines.pipeline import BLOCKS

    saved = set(_saved_params(state_dir))
    blocks = [t.path[0] for t in weights.tensors if t.path[0] not in saved]
    blocks = list(dict.fromkeys(blocks))  # in order, once each
    if blocks and BLOCKS not in saved:
        raise KitError(
            f"hf export: the checkpoint in {state_dir} has no parameters {blocks[0]!r}; it was written "
            "by another model or with other settings"
        )
    group: Dict[str, Any] = {}
    for tensor in weights.tensors:
        key = BLOCKS if tensor.path[0] in blocks else tensor.path[0]
        if key not in group:
            group.clear()  # one group in memory at a time
            group[key] = _restore(state_dir, key)
        leaf = _leaf(group[key], tensor.path[1:])
        if key == BLOCKS:  # stacked [layers, ...] or, circular, [repeats, layers / repeats, ...]: the model's order
            stacked = 1 if config.pipeline_repeats <= 1 else 2
            leaf = leaf.reshape((-1,) + leaf.shape[stacked:])[blocks.index(tensor.path[0])]
        yield tensor.name, layout.to_tensor(tensor, np.asarray(leaf))


def _leaf(tree: Any, path: Tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _saved_params(state_dir: str) -> Any:
    """The saved state's parameter groups (shapes and dtypes, from the checkpoint's metadata)."""
    import orbax.checkpoint as ocp

    saved = ocp.PyTreeCheckpointer().metadata(state_dir)
    saved = getattr(saved, "item_metadata", saved)
    return getattr(saved, "tree", saved)["params"]


def _restore(state_dir: str, key: str) -> Any:
    """One top-level parameter group of a saved train state, whole, on this host's first device."""
    import jax
    import orbax.checkpoint as ocp

    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = {
        "params": {
            key: jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), _saved_params(state_dir)[key])
        }
    }
    restored = ocp.PyTreeCheckpointer().restore(
        state_dir,
        args=ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True),
    )
    return jax.tree_util.tree_map(np.asarray, restored["params"][key])


# ----- logits --------------------------------------------------------------------------------------
def model_args_from(checkpoint: HfCheckpoint, settings: Dict[str, str], given: Dict[str, Any]) -> Dict[str, Any]:
    """The model's settings a checkpoint's config.json gives (each entry the layout names), under `given`."""
    values = {}
    for dotted, name in settings.items():
        value = layout.config_entry(checkpoint.config, dotted)
        if value is not None:
            values[name] = value
    values.update(given)
    return values


def logits(
    directory: str, tokens_file: str, out_file: str, model_name: str, given: Dict[str, Any]
) -> Tuple[Tuple[int, ...], Dict[str, Any]]:
    """Writes the float32 logits for the token ids in `tokens_file` ([seq] or [batch, seq]); returns (their
    shape, the model settings read from the checkpoint)."""
    import jax

    from alpa_job.hf.load import read_params
    from alpa_job.models import build_model

    checkpoint = HfCheckpoint(directory, flag="hf logits")
    try:
        tokens = np.load(tokens_file)
    except (OSError, ValueError) as err:
        raise KitError(f"hf logits --tokens {tokens_file}: cannot read it as a .npy file ({err}); save the ids with numpy.save") from None
    if tokens.ndim not in (1, 2) or not np.issubdtype(tokens.dtype, np.integer):
        raise KitError(
            f"hf logits --tokens {tokens_file}: {tokens.ndim}-d {tokens.dtype} array; give integer token ids shaped [seq] or [batch, seq]"
        )
    first, _ = build_model(_job_config({"model": model_name, "model_args": dict(given), "dtype": "float32"}))
    settings = layout.weights_of(first, model_name, flag="hf logits").settings
    args = model_args_from(checkpoint, settings, given)
    model, _ = build_model(_job_config({"model": model_name, "model_args": args, "dtype": "float32"}))
    weights = layout.weights_of(model, model_name, flag="hf logits")  # read_params checks the checkpoint fits it
    vocab = weights.config.get("vocab_size")
    if vocab is not None and (tokens.min() < 0 or tokens.max() >= vocab):
        raise KitError(
            f"hf logits --tokens {tokens_file}: ids from {tokens.min()} to {tokens.max()}, and the "
            f"checkpoint's vocabulary has {vocab}; give ids in 0..{vocab - 1}"
        )
    batch = tokens[None] if tokens.ndim == 1 else tokens
    # The kit's token convention: a model reads a row's tokens but the last (which only the loss reads), so a
    # row of seq + 1 gives the logits of all seq given tokens; the appended id is never read.
    batch = np.concatenate([batch, np.zeros_like(batch[:, :1])], axis=1)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.eval_shape(lambda: model.module.init(jax.random.PRNGKey(0), batch))["params"]
    from flax import linen as nn

    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), nn.meta.unbox(abstract))
    params = read_params(checkpoint, weights, abstract, model_name)
    out = np.asarray(jax.jit(model.module.apply)({"params": params}, batch), np.float32)
    out = out[0] if tokens.ndim == 1 else out
    np.save(out_file, out)
    return out.shape, args


def run(args) -> int:
    """The `hf` command (alpa_job/cli.py parses it)."""
    if args.hf_command == "export":
        step, files = export(args.run, args.dir, dtype=args.dtype, step=args.step)
        print(f"exported step {step} of {args.run} -> {args.dir}: {', '.join(files)}", flush=True)
        return EXIT_OK
    from alpa_job.setting import model_args

    given = dict(model_args(args.model_arg or [], "--model-arg"))
    shape, settings = logits(args.dir, args.tokens, args.out, args.model, given)
    print(
        f"logits {list(shape)} float32 -> {args.out} (model settings from {args.dir}: "
        + ", ".join(f"{k}={v}" for k, v in sorted(settings.items()))
        + ")",
        flush=True,
    )
    return EXIT_OK
