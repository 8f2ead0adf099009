"""Offline training inputs: the TTT batch from stored target features instead of a target run.

``eagle3_jax.data.features`` stores, per token, the three taps and the target's final normed
hidden state. The labels need only the target's output head: ``labels_from_hidden`` (shared with
online training in ``train/step.py``) scores the hidden state against the draft-vocabulary head
rows for the restricted log-softmax, and against all rows (in chunks) for the argmax. So
:func:`features_ttt_batch` gives the same :class:`~eagle3_jax.draft.ttt.TTTBatch` as
:func:`~eagle3_jax.train.step.target_ttt_batch`: exactly, up to float32 round-off, from
float32 features; within the storage rounding from bfloat16/float16 ones.

In the training loop (offline mode, ``TrainConfig.train_features``) the step's frozen inputs
are :func:`offline_frozen` ``{"embed", "head_rows"}`` and its ``make_inputs`` is
:class:`FeatureInputs`; the batches come from the same grain pipeline as token records
(:func:`eagle3_jax.data.make_dataset` over a :class:`FeatureShards`, which carries taps and
hidden along; :func:`eagle3_jax.data.features.make_feature_iterator` is a shorthand).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle3_jax.data.features import FeatureShards, make_feature_iterator
from eagle3_jax.data.sources import DataError
from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.params import VocabMap
from eagle3_jax.draft.ttt import TTTBatch
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import Params
from eagle3_jax.train.step import _head_columns, labels_from_hidden

__all__ = ["FeatureError", "FeatureInputs", "FeatureShards", "features_ttt_batch",
           "make_feature_iterator", "offline_frozen", "target_head_rows"]


class FeatureError(DataError):
    """Stored features that do not fit the head / draft they are used with."""


def target_head_rows(target_params: Params, target_cfg: TargetConfig) -> jax.Array:
    """The target's output head as [V, D] rows: all offline training needs of the target besides
    the (frozen) embedding table the draft reads its input tokens from."""
    return _head_columns(target_params, target_cfg)


def offline_frozen(target_params: Params, target_cfg: TargetConfig) -> Params:
    """``{"embed" [V, D], "head_rows" [V, D]}``: the frozen target arrays offline training keeps
    (the same array twice for a tied head). Drop ``target_params`` afterwards to free the rest."""
    return {"embed": target_params["embed"],
            "head_rows": target_head_rows(target_params, target_cfg)}


def features_ttt_batch(head_rows: jax.Array, draft_cfg: DraftConfig, vocab: VocabMap,
                       batch: dict[str, jax.Array]) -> TTTBatch:
    """The TTT inputs of a batch of stored features (jit-friendly; shapes are checked at trace).

    Args:
      head_rows: [V, D] the output head (:func:`target_head_rows`), in the target's dtype.
      draft_cfg: the draft head's config (its hidden size and number of taps are checked).
      vocab: draft <-> target vocabulary maps.
      batch: tokens, loss_mask, segment_ids, positions [B, T]; taps [B, T, 3D]; hidden
        [B, T, D] (any float dtype; computed in the head's dtype, as the target computes).
    Raises:
      FeatureError: the features' width does not match the head or the draft (features made
        with another target).
    """
    taps, hidden = batch["taps"], batch["hidden"]
    v, d = head_rows.shape
    if hidden.shape[-1] != d or draft_cfg.hidden_size != d:
        raise FeatureError(f"stored hidden states are {hidden.shape[-1]} wide, the target head is "
                           f"[{v}, {d}] and the draft's hidden size {draft_cfg.hidden_size}: the "
                           "features were made with another target")
    if taps.shape[-1] != draft_cfg.num_taps * d:
        raise FeatureError(f"stored taps are {taps.shape[-1]} wide, the draft fuses "
                           f"{draft_cfg.num_taps} x {d} = {draft_cfg.num_taps * d}")
    if vocab.t2d.shape[0] != v:
        raise FeatureError(f"the vocabulary map covers {vocab.t2d.shape[0]} target ids, the head "
                           f"has {v} rows")
    compute = head_rows.dtype
    target_logp, in_draft = labels_from_hidden(hidden.astype(compute), head_rows, vocab)
    return jax.lax.stop_gradient(TTTBatch(
        tokens=batch["tokens"], taps=taps.astype(compute), target_logp=target_logp,
        target_in_draft=in_draft, loss_mask=jnp.asarray(batch["loss_mask"]).astype(bool),
        segment_ids=batch["segment_ids"], positions=batch["positions"],
    ))


@dataclasses.dataclass(frozen=True)
class FeatureInputs:
    """``make_inputs`` of offline training (``train/step.py``): ``frozen`` is
    :func:`offline_frozen`'s dict and each batch holds the stored taps and hidden states.
    Hashable, so it can be a static jit argument."""

    draft_cfg: DraftConfig

    def __call__(self, frozen: Params, vocab: VocabMap, batch: dict[str, jax.Array]) -> TTTBatch:
        return features_ttt_batch(frozen["head_rows"], self.draft_cfg, vocab, batch)
