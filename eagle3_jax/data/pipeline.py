"""The grain input pipeline: tokenised records (or stored features) -> shuffled, padded or
packed, batched numpy. One pipeline serves online training (token records) and offline training
(``data/features.py``'s FeatureShards, whose records also carry taps and hidden states).

Order of operations (grain 0.2.18 dataset API):

    MapDataset.source(records)           records[i] = {input_ids [T], loss_mask [T], extras..}
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
Extra per-token arrays of the records (:func:`token_features`: any array value with one row per
token, e.g. FeatureShards' taps [T, 3D] and hidden [T, D]) come along under their own names as
[batch_size, max_len, ...] in their own dtype: truncated, padded with zeros, and packed along the
token axis exactly like the tokens.

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
                        "FeatureShards, or a path to a .npz/.jsonl of them")
    return records


# name -> (trailing shape, dtype) of a per-token array: [T, *shape] in every record.
TokenFeatures = tuple[tuple[str, tuple[int, ...], np.dtype], ...]


def token_features(source: Any) -> TokenFeatures:
    """The extra per-token arrays of a source's records, read off record 0: every value besides
    input_ids / loss_mask that is an array with one row per token (e.g. taps [T, 3D], hidden
    [T, D] of ``FeatureShards``). Each is carried into the batches beside the tokens."""
    if len(source) == 0:
        return ()
    first = source[0]
    n = len(first["input_ids"])
    out = []
    for name, value in first.items():
        if name in ("input_ids", "loss_mask") or not isinstance(value, np.ndarray):
            continue
        if value.ndim >= 1 and value.shape[0] == n:
            out.append((name, tuple(value.shape[1:]), value.dtype))
    return tuple(out)


def _truncate(record: Mapping, max_len: int, extras: TokenFeatures) -> dict[str, np.ndarray]:
    tokens = np.asarray(record["input_ids"], np.int32)[:max_len]
    n = len(tokens)
    row = {"tokens": tokens, "loss_mask": np.asarray(record["loss_mask"], bool)[:n]}
    for name, shape, dtype in extras:
        value = np.asarray(record[name])[:n]  # a memory-map slice stays unread until copied
        if value.shape != (n, *shape):
            raise DataError(f"record {name} has shape {value.shape}, expected {(n, *shape)} "
                            "(one row per token, as in record 0)")
        row[name] = value
    return row


def _non_empty(row: Mapping) -> bool:
    return len(row["tokens"]) > 0


def _pad_row(row: Mapping, max_len: int, extras: TokenFeatures) -> dict[str, np.ndarray]:
    n = len(row["tokens"])
    out = _empty_row(max_len, extras)
    out["tokens"][:n] = row["tokens"]
    out["loss_mask"][:n] = row["loss_mask"]
    out["segment_ids"][:n] = 1
    out["positions"][:n] = np.arange(n, dtype=np.int32)
    for name, _, _ in extras:
        out[name][:n] = row[name]
    return out


def _from_packed(row: Mapping, extras: TokenFeatures) -> dict[str, np.ndarray]:
    # FirstFitPackIterDataset adds <feature>_segment_ids / <feature>_positions per feature; all
    # features are packed alike, so the token ones describe the extras too.
    out = {"tokens": row["tokens"].astype(np.int32),
           "loss_mask": row["loss_mask"].astype(bool),
           "segment_ids": row["tokens_segment_ids"].astype(np.int32),
           "positions": row["tokens_positions"].astype(np.int32)}
    for name, _, dtype in extras:
        out[name] = row[name].astype(dtype, copy=False)
    return out


def _empty_row(max_len: int, extras: TokenFeatures) -> dict[str, np.ndarray]:
    out = {"tokens": np.zeros((max_len,), np.int32), "loss_mask": np.zeros((max_len,), bool),
           "segment_ids": np.zeros((max_len,), np.int32),
           "positions": np.zeros((max_len,), np.int32)}
    for name, shape, dtype in extras:
        out[name] = np.zeros((max_len, *shape), dtype)
    return out


def _stack(rows: Sequence[Mapping], batch_size: int, max_len: int,
           extras: TokenFeatures) -> dict[str, np.ndarray]:
    # Static shapes: a short final batch gets all-padding rows (segment 0, no loss).
    rows = list(rows) + [_empty_row(max_len, extras)] * (batch_size - len(rows))
    keys = BATCH_KEYS + tuple(name for name, _, _ in extras)
    return {k: np.stack([r[k] for r in rows]) for k in keys}


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
    extras = token_features(source)
    ds = ds.map(functools.partial(_truncate, max_len=max_len, extras=extras)).filter(_non_empty)
    it = ds.to_iter_dataset()
    if pack:
        # Every per-token array is packed along its token axis into the same bins.
        length = {name: max_len for name in ("tokens", "loss_mask", *(e[0] for e in extras))}
        it = FirstFitPackIterDataset(it, length_struct=length, num_packing_bins=batch_size,
                                     seed=seed, shuffle_bins=shuffle)
        it = it.map(functools.partial(_from_packed, extras=extras))
    else:
        it = it.map(functools.partial(_pad_row, max_len=max_len, extras=extras))
    it = it.batch(batch_size, drop_remainder=False,
                  batch_fn=functools.partial(_stack, batch_size=batch_size, max_len=max_len,
                                             extras=extras))
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
    """A checkpointable iterator of batches {tokens, loss_mask, segment_ids, positions, extras}.

    Args:
      records: a sequence of {input_ids, loss_mask, extra per-token arrays} (e.g.
        TokenizedRecords, or FeatureShards with taps and hidden) or a path to a ``.npz``
        (TokenizedRecords.save) or ``.jsonl`` of them.
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
