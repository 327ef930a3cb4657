"""The input checks before Ray: paths, file sizes, token ids, rows against the batch, eval flags.

Cheap reads only (file sizes, a sample of token ids, one record): a wrong dataset is a one-line error
in seconds, before a cluster is joined, and never a full scan of a large corpus.
"""

from __future__ import annotations

import os

from alpa_job.data.open import EVAL, TRAIN, model_setting, path_flag, split_path, token_window
from alpa_job.errors import KitError
from alpa_job.settings.catalog import FILE_DATASETS

GRAIN_ONLY = ("array_record", "model")  # need Grain / ArrayRecord, which the Alpa image's Python 3.9 lacks


def check_data(config, engine: str = "jax") -> None:
    """The dataset exists, gives what the model reads, and the batch fits it (sizes, a sample of token ids:
    nothing is loaded whole). A brought model was matched against the dataset when it was built."""
    from alpa_job.data.memory import cifar10_batch_files
    from alpa_job.models import check_data_fits, is_built_in

    if is_built_in(config.model):
        check_data_fits(config, config.model)
    check_input(config, engine)
    if config.dataset == "cifar10":
        for name in cifar10_batch_files(config.data_dir):
            _check_pickle_header(os.path.join(config.data_dir, name))
    elif config.dataset == "synthetic":
        from alpa_job.data.batching import plan_epoch

        plan_epoch(config.num_samples, config.batch_size, config.remainder)


def _check_pickle_header(path: str) -> None:
    """A CIFAR-10 python batch is a pickle (protocol >= 2 starts with 0x80, then the protocol number):
    two bytes tell a wrong file now, not after Ray started and a worker tried to load it."""
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError as err:
        raise KitError(f"--data-dir: cannot read {path} ({err.strerror}); fix its permissions") from None
    if len(head) < 2 or head[0] != 0x80 or not 2 <= head[1] <= 5:
        raise KitError(f"{path} is not a CIFAR-10 python batch (not a pickle); re-extract cifar-10-python.tar.gz")


def check_input(config, engine: str = "jax") -> None:
    """Every input mistake the config and the files show, as a KitError naming the fix."""
    _check_eval_flags(config)
    if engine == "alpa" and config.dataset in GRAIN_ONLY:
        raise KitError(
            f"--dataset {config.dataset} needs Grain and ArrayRecord, which the Alpa image's Python 3.9 "
            "cannot install; use --engine jax, or --dataset tokens|npz with --engine alpa"
        )
    if config.dataset not in FILE_DATASETS:
        return
    for split in (TRAIN, EVAL):
        if split_path(config, split) or split == TRAIN:
            _check_split(config, split)


def _check_eval_flags(config) -> None:
    if config.eval_data_path and config.dataset not in FILE_DATASETS:
        raise KitError(
            f"--eval-data-path: --dataset {config.dataset} has no eval split in files; use --dataset "
            f"{'|'.join(FILE_DATASETS)} or drop --eval-data-path"
        )
    if not config.eval_data_path and (config.eval_every or config.eval_batches):
        flag = "--eval-every" if config.eval_every else "--eval-batches"
        raise KitError(f"{flag} needs eval data: add --eval-data-path PATH (in --dataset's format) or drop {flag}")


def _check_split(config, split: str) -> None:
    if not split_path(config, split):
        raise KitError(f"--dataset {config.dataset} reads files: add {path_flag(split)} PATH")
    if config.dataset == "tokens":
        _check_tokens(config, split)
    elif config.dataset == "npz":
        from alpa_job.data.memory import load_npz

        dataset = load_npz(split_path(config, split))
        _check_fields(config, set(dataset.arrays), split)
        _check_rows(config, dataset.num_samples, "rows", split)
    elif config.dataset == "array_record":
        _check_records(config, split)
    # --dataset model: the model's own dataset() is built in the training process


def _check_tokens(config, split: str) -> None:
    from alpa_job.data.tokens import TokenWindows, expand_paths

    window = token_window(config)
    source = TokenWindows(expand_paths(split_path(config, split), path_flag(split)), config.token_dtype, window)
    if len(source) < config.batch_size and split == TRAIN:
        raise KitError(
            f"{path_flag(split)}: {source.tokens:,} tokens make {len(source)} windows of {window}, fewer "
            f"than one global batch ({config.batch_size}); add data or lower --batch-size/--seq-len"
        )
    if not len(source):
        raise KitError(f"{path_flag(split)}: {source.tokens:,} tokens make no window of {window} tokens; add data or lower --seq-len")
    vocab = model_setting(config, "vocab_size")
    for path in source.paths:
        _check_sidecar(path, config.token_dtype, vocab)
    if vocab:
        top = source.sample_max_id()
        if top >= int(vocab):
            raise KitError(
                f"{path_flag(split)}: token id {top} (max id in a sample) is >= --vocab-size {vocab}; "
                f"use --vocab-size {top + 1} or more (the tokenizer's vocabulary), or check --token-dtype"
            )


def _check_sidecar(path: str, dtype: str, vocab) -> None:
    """What `data tokenize` wrote beside the file (tokenizer's vocabulary, id type), when it is there."""
    import json

    from alpa_job.data.tokenize import sidecar_path

    try:
        with open(sidecar_path(path)) as handle:
            made = json.load(handle)
    except (OSError, ValueError):
        return  # a token file from elsewhere: the sampled ids are checked instead
    if made.get("dtype") and made["dtype"] != dtype:
        raise KitError(f"{path} holds {made['dtype']} ids (says {sidecar_path(path)}); use --token-dtype {made['dtype']}")
    if vocab and made.get("vocab_size") and int(made["vocab_size"]) > int(vocab):
        raise KitError(
            f"{path} was tokenized with a {made['vocab_size']}-token vocabulary ({made.get('tokenizer')}), "
            f"more than --vocab-size {vocab}; use --vocab-size {made['vocab_size']} or more"
        )


def _check_records(config, split: str) -> None:
    from alpa_job.data.records import RecordSource
    from alpa_job.data.tokens import expand_paths
    from alpa_job.models import is_built_in

    source = RecordSource(expand_paths(split_path(config, split), path_flag(split)))
    _check_rows(config, len(source), "records", split)
    if is_built_in(config.model):  # a brought model's own decode() is tried where it is built
        _check_fields(config, set(source.read([0])), split)


def _check_rows(config, rows: int, what: str, split: str) -> None:
    if split == TRAIN:
        from alpa_job.data.batching import plan_epoch

        plan_epoch(rows, config.batch_size, config.remainder)
    elif not rows:
        raise KitError(f"{path_flag(split)} holds no {what}; point it at the eval split")


def _check_fields(config, fields: set, split: str) -> None:
    """A built-in model's input field is in the data (a brought model is checked where it is built)."""
    from alpa_job.models import is_built_in, model_input_field

    if not is_built_in(config.model):
        return
    field = model_input_field(config.model)
    if field not in fields:
        raise KitError(
            f"{path_flag(split)}: the data's fields are {', '.join(sorted(fields))}, and --model "
            f"{config.model} reads {field!r}; give the data a {field!r} field or pick a model that reads "
            "one of those"
        )
