"""ArrayRecord files of serialized examples (`--dataset array_record`).

ArrayRecord is the random-access record format Grain reads natively. Each record is one example;
the model package's `decode(record_bytes) -> {field: array}` turns it into arrays, or the built-in
decoder reads records written by `write_records` (a msgpack map of field -> array, flax's
serialization: self-describing, no schema file), for `{"tokens"}` or `{"image", "label"}` examples.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional

import numpy as np

from alpa_job.data.sources import RowSource
from alpa_job.errors import KitError

Decoder = Callable[[bytes], Dict[str, np.ndarray]]


def builtin_decode(record: bytes) -> Dict[str, np.ndarray]:
    from flax import serialization

    example = serialization.msgpack_restore(record)
    if not isinstance(example, dict):
        raise ValueError("not a msgpack map of field -> array")
    return {k: np.asarray(v) for k, v in example.items()}


def write_records(path: str, examples: Iterable[Dict[str, np.ndarray]]) -> int:
    """Write examples as an ArrayRecord file the built-in decoder reads; returns the count."""
    from array_record.python.array_record_module import ArrayRecordWriter
    from flax import serialization

    writer = ArrayRecordWriter(path, "group_size:1")  # one record per chunk: cheapest random access
    count = 0
    try:
        for example in examples:
            writer.write(serialization.msgpack_serialize({k: np.asarray(v) for k, v in example.items()}))
            count += 1
    finally:
        writer.close()
    return count


class RecordSource(RowSource):
    """Records of one or more ArrayRecord files, decoded per row by `decode`."""

    def __init__(self, paths: List[str], decode: Optional[Decoder] = None):
        super().__init__()
        import grain
        from array_record.python.array_record_module import ArrayRecordReader

        self.paths = paths
        self.decode = decode or builtin_decode
        counts = []
        for path in paths:
            try:
                reader = ArrayRecordReader(path)
            except Exception as err:  # noqa: BLE001 - the reader raises bare RuntimeErrors/ValueErrors
                raise KitError(
                    f"{path} is not an ArrayRecord file ({_first_line(err)}); write it with array_record's ArrayRecordWriter"
                ) from None
            counts.append(reader.num_records())
            reader.close()
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.source = grain.sources.ArrayRecordDataSource(paths)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def describe(self) -> str:
        return f"array_record: {len(self.paths)} file(s), {len(self):,} records"

    def locate(self, index: int):
        f = int(np.searchsorted(self._starts, index, side="right") - 1)
        return self.paths[f], index - int(self._starts[f])

    def _read(self, indices: np.ndarray) -> Dict[str, np.ndarray]:
        records = self.source.__getitems__([int(i) for i in indices])
        rows = [self._decode_one(record, int(i)) for record, i in zip(records, indices)]
        fields = rows[0].keys()
        for row, index in zip(rows, indices):
            if row.keys() != fields:
                path, at = self.locate(int(index))
                raise KitError(
                    f"{path} record {at} has fields {sorted(row)}, record 0 of the batch has "
                    f"{sorted(fields)}; every record needs the same fields"
                )
        return {k: np.stack([row[k] for row in rows]) for k in fields}

    def _decode_one(self, record: bytes, index: int) -> Dict[str, np.ndarray]:
        try:
            return self.decode(record)
        except Exception as err:  # noqa: BLE001 - a user's decoder may raise anything: name the record
            path, at = self.locate(index)
            raise KitError(
                f"{path} record {at} does not decode ({type(err).__name__}: {_first_line(err)}); "
                "fix the record or the model's decode function"
            ) from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__
