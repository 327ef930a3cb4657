"""Which row source a job reads: `--dataset` and its paths, for the train or the eval split."""

from __future__ import annotations

from typing import Any, Optional

from alpa_job.data.sources import ArraysSource, MapDatasetSource, RowSource
from alpa_job.errors import KitError

TRAIN, EVAL = "train", "eval"


def split_path(config, split: str) -> Optional[str]:
    return config.data_path if split == TRAIN else config.eval_data_path


def path_flag(split: str) -> str:
    return "--data-path" if split == TRAIN else "--eval-data-path"


def model_setting(config, name: str) -> Optional[Any]:
    """A setting of the model (`seq_len`, `vocab_size`), typed by its declaration; None if it has none."""
    from alpa_job.models import model_values

    return model_values(config).get(name)


def token_window(config) -> int:
    """seq_len + 1 tokens a row: the model reads the first seq_len and predicts the last seq_len."""
    seq_len = model_setting(config, "seq_len")
    if not seq_len:
        raise KitError(
            f"--dataset tokens: --model {config.model} declares no seq_len setting, so the kit cannot "
            "cut token windows; add seq_len to its builder's settings or use --dataset array_record"
        )
    return int(seq_len) + 1


def open_source(config, split: str = TRAIN, model=None) -> RowSource:
    """The split's rows; `model` (a models.ModelSpec) supplies synthetic data, a decoder or its own dataset."""
    kind = config.dataset
    if kind == "synthetic":
        from alpa_job.data.memory import synthetic

        return ArraysSource(synthetic(config, model), "synthetic")
    if kind == "cifar10":
        from alpa_job.data.memory import load_cifar10

        return ArraysSource(load_cifar10(config.data_dir), f"cifar10 {config.data_dir}")
    path = split_path(config, split)
    if not path:
        raise KitError(f"--dataset {kind} reads files: add {path_flag(split)} PATH")
    if kind == "npz":
        from alpa_job.data.memory import load_npz

        return ArraysSource(load_npz(path), f"npz {path}")
    if kind == "tokens":
        from alpa_job.data.tokens import TokenWindows, expand_paths

        vocab = model_setting(config, "vocab_size")
        return TokenWindows(
            expand_paths(path, path_flag(split)), config.token_dtype, token_window(config), vocab_size=int(vocab) if vocab else None
        )
    if kind == "array_record":
        from alpa_job.data.records import RecordSource
        from alpa_job.data.tokens import expand_paths

        return RecordSource(expand_paths(path, path_flag(split)), decode=getattr(model, "decode", None))
    if kind == "model":
        return MapDatasetSource(_model_dataset(config, model, path, split), f"{config.model} dataset {path}")
    raise KitError(f"--dataset {kind!r} is not known")


def open_train(config, model=None):
    """(the training rows, their fixed-shape epoch plan, the first global batch): the batch is the one shape
    every step is compiled for, and its fields must include the model's input."""
    from alpa_job.data.batching import plan_epoch
    from alpa_job.data.pipeline import InputStream

    source = open_source(config, TRAIN, model)
    epoch = plan_epoch(len(source), config.batch_size, config.remainder)
    example = InputStream(source, epoch, config.batch_size, config.seed, 1).local_batch(0)
    if model is not None and model.input_key not in example:
        fields = ", ".join(sorted(k for k in example if k != "mask"))
        raise KitError(
            f"--dataset {config.dataset} gives the field(s) {fields}, and --model {config.model} reads "
            f"{model.input_key!r}; give the data that field or change the model's input_field"
        )
    return source, epoch, example


def _model_dataset(config, model, path: str, split: str):
    if model is None:
        from alpa_job.models import get_model

        model = get_model(config)
    if model.dataset is None:
        raise KitError(f"--dataset model: --model {config.model} provides no dataset (dataset=None in its api.Model)")
    dataset = model.dataset(path, split)
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise KitError(
            f"--dataset model: --model {config.model}'s dataset() returned {type(dataset).__name__}; "
            "return a grain.MapDataset (random access: the kit shuffles, shards and resumes by index)"
        )
    return dataset
