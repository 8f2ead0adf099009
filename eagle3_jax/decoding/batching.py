"""Pad prompts of different lengths into a few static shapes, so jit compiles a handful of times.

Every distinct ``[B, P]`` shape (and cache size) is a new XLA compilation, so prompts are padded:

* **length**: right-padded to the next bucket, by default a power of two >= 16
  (16, 32, 64, ...), capped at the model context;
* **batch**: extra rows up to the next power of two (1, 2, 4, 8, ...). An extra row has
  length 0, and :func:`eagle3_jax.decoding.generate` treats a length-0 row as finished before
  it starts: it generates nothing and its output row is all -1.

Right padding keeps every real token at its true position (0..len-1), so no position offsets are
needed; ``generate`` overwrites the pad slots of the KV cache as it decodes.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


def bucket(n: int, minimum: int = 16, maximum: int | None = None) -> int:
    """Smallest ``minimum * 2**i`` >= n, capped at ``maximum`` (so it may be < n)."""
    if n < 0:
        raise ValueError(f"cannot bucket a negative size {n}")
    size = max(minimum, 1)
    while size < n:
        size *= 2
    if maximum is not None:
        size = min(size, maximum)
    return size


@dataclasses.dataclass(frozen=True)
class PaddedPrompts:
    """Prompts as one padded batch.

    Attributes:
      tokens: [B, P] int32, row i holds prompt i then ``pad_id``.
      lengths: [B] int32 true lengths; 0 for padding rows.
      num_prompts: how many leading rows are real prompts (the rest are batch padding).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    num_prompts: int


def pad_prompts(
    prompts: Sequence[Sequence[int]],
    *,
    pad_id: int = 0,
    min_length: int = 16,
    max_length: int | None = None,
    pad_batch: bool = True,
) -> PaddedPrompts:
    """Right-pad token-id prompts to a length bucket, and the batch to a power of two.

    Args:
      prompts: token-id lists, each non-empty.
      pad_id: id written into padding (never attended to, so any valid id works).
      min_length: smallest length bucket; buckets are ``min_length * 2**i``.
      max_length: cap on the length bucket (the model context); a longer prompt is an error.
      pad_batch: pad the number of rows up to a power of two.
    """
    if not prompts:
        raise ValueError("pad_prompts needs at least one prompt")
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise ValueError(f"prompt {lengths.index(0)} is empty; every prompt needs >= 1 token")
    longest = max(lengths)
    if max_length is not None and longest > max_length:
        raise ValueError(
            f"prompt {lengths.index(longest)} has {longest} tokens but the model context is "
            f"{max_length}; shorten the prompt"
        )
    width = bucket(longest, min_length, max_length)
    rows = bucket(len(prompts), 1) if pad_batch else len(prompts)
    tokens = np.full((rows, width), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    padded_lengths = np.zeros((rows,), np.int32)
    padded_lengths[: len(prompts)] = lengths
    return PaddedPrompts(tokens=tokens, lengths=padded_lengths, num_prompts=len(prompts))
