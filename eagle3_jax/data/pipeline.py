"""The grain input pipeline: tokenised records -> shuffled, padded or packed, batched numpy.

Order of operations (grain 0.2.18 dataset API):

    MapDataset.source(records)           records[i] = {input_ids [T], loss_mask [T]}
      .shuffle(seed)                     a fresh permutation each epoch (repeat reseeds it)
      .repeat(num_epochs)                None = forever
      .map(truncate to max_len)
      .to_iter_dataset()
      pad each row  |  FirstFitPackIterDataset (batch_size bins of max_len tokens)
      .batch(batch_size)                 the last partial batch is filled with padding rows
      rows [shard_index::shard_count]    this host's rows of the global batch

Every host builds the same *global* batches and keeps its own rows, so the data a model sees
does not depend on the topology: 2 processes x 4 devices train on exactly the batches of 1
process x 8 devices (the price is that every host pads/packs every row, cheap next to a step).

Every batch is a dict of numpy arrays, all [batch_size, max_len]:
    tokens int32, loss_mask bool, segment_ids int32 (1, 2, 3.. per document in a row, 0 on
    padding), positions int32 (0.. restarting at each document, 0 on padding).

The iterator is a ``grain.DatasetIterator``: ``get_state()`` returns a JSON-able dict and
``set_state(state)`` resumes exactly there. For orbax, grain provides
``grain.checkpoint.CheckpointHandler`` with args ``grain.checkpoint.CheckpointSave`` /
``CheckpointRestore`` (aliases ``grain.python.PyGrainCheckpointHandler``,
``PyGrainCheckpointSave``, ``PyGrainCheckpointRestore``), one JSON file per process.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Mapping, Sequence

import grain
import numpy as np
from grain.experimental import FirstFitPackIterDataset

from eagle3_jax.data.sources import DataError
from eagle3_jax.data.tokenize import TokenizedRecords

BATCH_KEYS = ("tokens", "loss_mask", "segment_ids", "positions")


def _as_source(records: Any) -> Any:
    if isinstance(records, (str, Path)):
        return TokenizedRecords.load(records)
    if not hasattr(records, "__len__") or not hasattr(records, "__getitem__"):
        raise DataError("records must be a sequence of {input_ids, loss_mask}, TokenizedRecords, "
                        "or a path to a .npz/.jsonl of them")
    return records


def _truncate(record: Mapping, max_len: int) -> dict[str, np.ndarray]:
    tokens = np.asarray(record["input_ids"], np.int32)[:max_len]
    return {"tokens": tokens, "loss_mask": np.asarray(record["loss_mask"], bool)[:len(tokens)]}


def _non_empty(row: Mapping) -> bool:
    return len(row["tokens"]) > 0


def _pad_row(row: Mapping, max_len: int) -> dict[str, np.ndarray]:
    n = len(row["tokens"])
    out = _empty_row(max_len)
    out["tokens"][:n] = row["tokens"]
    out["loss_mask"][:n] = row["loss_mask"]
    out["segment_ids"][:n] = 1
    out["positions"][:n] = np.arange(n, dtype=np.int32)
    return out


def _from_packed(row: Mapping) -> dict[str, np.ndarray]:
    # FirstFitPackIterDataset adds <feature>_segment_ids / <feature>_positions per feature.
    return {"tokens": row["tokens"].astype(np.int32),
            "loss_mask": row["loss_mask"].astype(bool),
            "segment_ids": row["tokens_segment_ids"].astype(np.int32),
            "positions": row["tokens_positions"].astype(np.int32)}


def _empty_row(max_len: int) -> dict[str, np.ndarray]:
    return {"tokens": np.zeros((max_len,), np.int32), "loss_mask": np.zeros((max_len,), bool),
            "segment_ids": np.zeros((max_len,), np.int32),
            "positions": np.zeros((max_len,), np.int32)}


def _stack(rows: Sequence[Mapping], batch_size: int, max_len: int) -> dict[str, np.ndarray]:
    # Static shapes: a short final batch gets all-padding rows (segment 0, no loss).
    rows = list(rows) + [_empty_row(max_len)] * (batch_size - len(rows))
    return {k: np.stack([r[k] for r in rows]) for k in BATCH_KEYS}


def make_dataset(
    records: Any,
    *,
    batch_size: int,
    max_len: int,
    seed: int,
    shuffle: bool = True,
    pack: bool = False,
    num_epochs: int | None = None,
    shard_index: int | None = None,
    shard_count: int | None = None,
) -> grain.IterDataset:
    """The batched ``grain.IterDataset`` (see module doc); shard defaults: this jax process."""
    if batch_size < 1 or max_len < 1:
        raise DataError(f"batch_size ({batch_size}) and max_len ({max_len}) must be positive")
    if shard_index is None or shard_count is None:
        import jax

        shard_index, shard_count = jax.process_index(), jax.process_count()
    if not 0 <= shard_index < shard_count:
        raise DataError(f"shard_index {shard_index} must be in [0, {shard_count})")
    if batch_size % shard_count:
        raise DataError(f"global batch_size {batch_size} must be a multiple of the number of "
                        f"host shards {shard_count}")
    source = _as_source(records)
    ds = grain.MapDataset.source(source)
    if len(ds) == 0:
        raise DataError("no records to train on")
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)  # reseeds the shuffle every epoch
    ds = ds.map(functools.partial(_truncate, max_len=max_len)).filter(_non_empty)
    it = ds.to_iter_dataset()
    if pack:
        length = {"tokens": max_len, "loss_mask": max_len}
        it = FirstFitPackIterDataset(it, length_struct=length, num_packing_bins=batch_size,
                                     seed=seed, shuffle_bins=shuffle)
        it = it.map(_from_packed)
    else:
        it = it.map(functools.partial(_pad_row, max_len=max_len))
    it = it.batch(batch_size, drop_remainder=False,
                  batch_fn=functools.partial(_stack, batch_size=batch_size, max_len=max_len))
    if shard_count > 1:
        it = it.map(functools.partial(_host_rows, index=shard_index, count=shard_count))
    return it


def _host_rows(batch: dict[str, np.ndarray], *, index: int, count: int) -> dict[str, np.ndarray]:
    """Rows index, index + count, ... of a global batch: micro-batches stay whole per host."""
    return {name: value[index::count] for name, value in batch.items()}


def make_train_iterator(
    records: Any,
    *,
    batch_size: int,
    max_len: int,
    seed: int,
    shuffle: bool = True,
    pack: bool = False,
    num_epochs: int | None = None,
    shard_index: int | None = None,
    shard_count: int | None = None,
) -> grain.DatasetIterator:
    """A checkpointable iterator of batches {tokens, loss_mask, segment_ids, positions}.

    Args:
      records: a sequence of {input_ids, loss_mask} (e.g. TokenizedRecords) or a path to a
        ``.npz`` (TokenizedRecords.save) or ``.jsonl`` of them.
      batch_size, max_len: every global batch is [batch_size, max_len] (this host receives
        batch_size / shard_count of its rows); longer documents are truncated.
      seed: shuffle (and packing-bin shuffle) seed.
      pack: first-fit pack several documents per row instead of one padded document per row.
      num_epochs: None repeats forever.
      shard_index, shard_count: this host's slice; default jax.process_index()/process_count().
    """
    return iter(make_dataset(records, batch_size=batch_size, max_len=max_len, seed=seed,
                             shuffle=shuffle, pack=pack, num_epochs=num_epochs,
                             shard_index=shard_index, shard_count=shard_count))
