"""A Hugging Face checkpoint folder: config.json and one or more *.safetensors files (model.safetensors.index.json
names each tensor's file when there are several). Reading maps the files (safetensors), so a slice costs only
its own bytes: a device's shard of a large checkpoint is read without the whole tensor in memory."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from alpa_job.errors import KitError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
READABLE = ("BF16", "F16", "F32")  # the floating dtypes published checkpoints are saved in
SHARD_BYTES = 4 << 30  # an exported file's size limit, as transformers' default max_shard_size


def parse_source(value: str, flag: str = "--init-from") -> str:
    """The folder of `hf:DIR`."""
    if not value.startswith("hf:") or not value[3:]:
        raise KitError(f"{flag} {value!r}: name a Hugging Face checkpoint folder as hf:DIR (config.json and *.safetensors in it)")
    return value[3:]


def read_config(directory: str, flag: str = "--init-from") -> Dict[str, Any]:
    """The checkpoint's config.json, or one line naming what is missing."""
    if not os.path.isdir(directory):
        raise KitError(
            f"{flag} hf:{directory}: no such folder; download the checkpoint there first "
            "(e.g. huggingface-cli download ORG/MODEL --local-dir DIR)"
        )
    path = os.path.join(directory, CONFIG)
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise KitError(
            f"{flag} hf:{directory}: there is no {CONFIG}; a Hugging Face checkpoint folder has {CONFIG} beside its *.safetensors"
        ) from None
    except ValueError as err:
        raise KitError(f"{flag} hf:{directory}: {CONFIG} is not JSON ({err}); download it again") from None
    if not isinstance(config, dict):
        raise KitError(f"{flag} hf:{directory}: {CONFIG} is not a JSON object; download it again")
    return config


class HfCheckpoint:
    """One checkpoint folder: its config, which file holds each tensor, and slices of tensors."""

    def __init__(self, directory: str, flag: str = "--init-from"):
        self.directory, self.flag = directory, flag
        self.config = read_config(directory, flag)
        self._opened: Dict[str, Any] = {}
        self.files_of = self._weight_map()

    def _where(self) -> str:
        return f"{self.flag} hf:{self.directory}"

    def _weight_map(self) -> Dict[str, str]:
        index = os.path.join(self.directory, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map") or {}
            missing = sorted({name for name in weight_map.values() if not os.path.exists(os.path.join(self.directory, name))})
            if missing:
                raise KitError(
                    f"{self._where()}: {INDEX} names file(s) that are not there: {', '.join(missing)}; download the missing shards"
                )
            return dict(weight_map)
        files = sorted(n for n in os.listdir(self.directory) if n.endswith(".safetensors"))
        if not files:
            bins = [n for n in os.listdir(self.directory) if n.endswith((".bin", ".pt", ".pth"))]
            hint = f" (it has {', '.join(bins[:3])}: save it with safe_serialization=True, or convert it)" if bins else ""
            raise KitError(f"{self._where()}: no *.safetensors file{hint}; the kit reads safetensors checkpoints")
        weight_map = {}
        for name in files:
            for key in self._open(name).keys():
                weight_map[key] = name
        return weight_map

    def _open(self, file: str):
        from safetensors import safe_open

        if file not in self._opened:
            try:
                self._opened[file] = safe_open(os.path.join(self.directory, file), framework="numpy")
            except Exception as err:  # safetensors raises its own error types for a cut or corrupt file
                raise KitError(f"{self._where()}: cannot read {file} ({err}); download it again") from None
        return self._opened[file]

    def names(self) -> List[str]:
        return sorted(self.files_of)

    def info(self, name: str) -> Tuple[Tuple[int, ...], str]:
        """(shape, safetensors dtype) of one tensor, from its file's header."""
        part = self._open(self.files_of[name]).get_slice(name)
        return tuple(part.get_shape()), part.get_dtype()

    def read(self, name: str, index: Optional[Tuple[slice, ...]] = None) -> np.ndarray:
        """The tensor, or the slice `index` of it (reading only that slice's bytes)."""
        part = self._open(self.files_of[name]).get_slice(name)
        return np.asarray(part[index if index is not None else ...])


def write_checkpoint(
    directory: str, config: Dict[str, Any], tensors: Iterable[Tuple[str, np.ndarray]], dtype: Any, shard_bytes: int = SHARD_BYTES
) -> List[str]:
    """A checkpoint folder from (name, array) pairs, each cast to `dtype`, in files of at most `shard_bytes`
    (an index names each tensor's file when there are several); returns the files written. A file is written
    once it is full, so at most one file's tensors are held at a time. The folder must be new or empty:
    nothing already there is overwritten."""
    from safetensors.numpy import save_file

    if os.path.exists(directory) and os.listdir(directory):
        raise KitError(f"{directory} is not empty; export into a new folder (nothing there is overwritten)")
    os.makedirs(directory, exist_ok=True)
    parts: List[Tuple[str, List[str], int]] = []  # (its temporary file, its tensors, bytes)
    shard: Dict[str, np.ndarray] = {}

    def flush() -> None:
        part = os.path.join(directory, f".part-{len(parts):05d}.safetensors")
        save_file(shard, part, metadata={"format": "pt"})
        parts.append((part, list(shard), sum(a.nbytes for a in shard.values())))
        shard.clear()

    held = 0  # bytes in `shard`
    for name, array in tensors:
        array = np.ascontiguousarray(np.asarray(array).astype(dtype))
        if shard and held + array.nbytes > shard_bytes:
            flush()
            held = 0
        shard[name] = array
        held += array.nbytes
    flush()
    files = [SINGLE] if len(parts) == 1 else [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    for file, (part, _, _) in zip(files, parts):
        os.replace(part, os.path.join(directory, file))
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(size for _, _, size in parts)},
            "weight_map": {name: file for file, (_, names, _) in zip(files, parts) for name in names},
        }
        with open(os.path.join(directory, INDEX), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    with open(os.path.join(directory, CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return files + [CONFIG]
