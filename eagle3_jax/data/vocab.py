"""The draft vocabulary (reference §3): the most frequent target ids among assistant tokens.

Ranking: by count among loss-masked tokens (descending); ties, and ids never seen in an
assistant turn, by count among *all* tokens of the data (descending), then by smaller id. So when
the data has fewer distinct assistant tokens than ``draft_vocab_size``, the vocabulary is filled
first with the most frequent other tokens of the data (still plausible outputs) and then with the
lowest unused ids. The chosen ids are returned sorted ascending.

Saved as ``.npz``: ``d2t`` [Vd] int64 (``target_id = draft_id + d2t[draft_id]``), ``t2d`` [V]
bool, plus ``used_ids`` and the masked ``counts`` for inspection.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from eagle3_jax.data.sources import DataError


def count_tokens(records: Iterable[Mapping], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(masked counts [V] int64, all-token counts [V] int64) over records {input_ids, loss_mask}."""
    masked = np.zeros((vocab_size,), np.int64)
    every = np.zeros((vocab_size,), np.int64)
    for i, r in enumerate(records):
        ids = np.asarray(r["input_ids"], np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise DataError(f"record {i} has token ids outside the target vocabulary "
                            f"[0, {vocab_size})")
        every += np.bincount(ids, minlength=vocab_size)
        masked += np.bincount(ids[np.asarray(r["loss_mask"], bool)], minlength=vocab_size)
    return masked, every


def select_draft_vocab(masked_counts: np.ndarray, draft_vocab_size: int,
                       all_counts: np.ndarray | None = None) -> np.ndarray:
    """The ``draft_vocab_size`` best-ranked target ids (see module doc), sorted ascending."""
    vocab_size = len(masked_counts)
    if not 0 < draft_vocab_size <= vocab_size:
        raise DataError(f"draft vocab size {draft_vocab_size} must be in [1, {vocab_size}] "
                        "(the target vocabulary size)")
    if all_counts is None:
        all_counts = np.zeros_like(masked_counts)
    ids = np.arange(vocab_size)
    # np.lexsort sorts by the last key first: masked count desc, all count desc, id asc.
    order = np.lexsort((ids, -np.asarray(all_counts), -np.asarray(masked_counts)))
    return np.sort(order[:draft_vocab_size]).astype(np.int64)


def vocab_arrays(used_ids: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t [Vd] int64 with d2t[i] = used[i] - i, t2d [V] bool) of sorted unique ``used_ids``."""
    used = np.asarray(used_ids, np.int64)
    if np.any(np.diff(used) <= 0) or used.min() < 0 or used.max() >= vocab_size:
        raise DataError("draft vocabulary ids must be strictly increasing and inside the target "
                        "vocabulary")
    t2d = np.zeros((vocab_size,), bool)
    t2d[used] = True
    return used - np.arange(len(used), dtype=np.int64), t2d


def build_draft_vocab(records: Iterable[Mapping], vocab_size: int,
                      draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(used_ids [Vd] int64 sorted ascending, masked counts [V]) of tokenised records."""
    masked, every = count_tokens(records, vocab_size)
    if not masked.any():
        raise DataError("no loss-masked (assistant) tokens in the data")
    return select_draft_vocab(masked, draft_vocab_size, every), masked


def save_vocab(path: str | Path, used_ids: np.ndarray, vocab_size: int,
               counts: np.ndarray | None = None) -> Path:
    """Write d2t, t2d, used_ids (and counts) to ``path`` (.npz)."""
    d2t, t2d = vocab_arrays(used_ids, vocab_size)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part.npz")
    extra = {} if counts is None else {"counts": np.asarray(counts, np.int64)}
    np.savez(tmp, d2t=d2t, t2d=t2d, used_ids=np.asarray(used_ids, np.int64), **extra)
    tmp.replace(path)
    return path


def load_vocab(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(d2t [Vd] int64, t2d [V] bool) from a file written by :func:`save_vocab`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"draft vocabulary file {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as z:
            return z["d2t"].astype(np.int64), z["t2d"].astype(bool)
    except (OSError, KeyError, ValueError) as e:
        raise DataError(f"{path}: not a draft vocabulary .npz ({e})") from None


def load_vocab_map(path: str | Path):
    """The device-side :class:`~eagle3_jax.draft.params.VocabMap` of a saved vocabulary."""
    from eagle3_jax.draft.load import read_vocab_file

    if not Path(path).is_file():
        raise DataError(f"draft vocabulary file {path} does not exist")
    return read_vocab_file(path)
