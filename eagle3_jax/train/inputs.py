"""Training-time-test inputs: a data batch -> :class:`~eagle3_jax.draft.ttt.TTTBatch`.

One step function (``train/step.py``) serves online and offline training; what differs is
where the target's taps and final hidden state come from, so each mode is a ``make_inputs``:

    online   TargetInputs:  frozen = the target's full params, run inside the jitted step (no
             gradient) on tokens, segment_ids, positions [B, T] (:func:`target_ttt_batch`);
    offline  FeatureInputs: frozen = :func:`offline_frozen` ``{"embed", "head_rows"}``, and
             the batch already holds the stored taps [B, T, 3D] and hidden [B, T, D]
             (``eagle3_jax.data.features``; :func:`features_ttt_batch`).

Either way the labels are, per position, the target's log-probabilities restricted to the draft
vocabulary and whether its full-vocabulary argmax lies in the draft vocabulary
(:func:`labels_from_hidden`, used by both through :func:`_assemble`). Full-vocabulary float32
logits for a whole batch are never materialised: the restricted logits use only the Vd head
rows, and the argmax runs over vocabulary chunks. So the offline batch equals the online one:
exactly, up to float32 round-off, from float32 features; within the storage rounding from
bfloat16 / float16 ones.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from eagle3_jax.data.sources import DataError
from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.params import VocabMap
from eagle3_jax.draft.ttt import TTTBatch
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import Params
from eagle3_jax.model.target import forward_stacked, packed_causal_mask
from eagle3_jax.sharding.activations import shard_batch

__all__ = ["FeatureError", "FeatureInputs", "MakeInputs", "TargetInputs", "chunked_argmax",
           "features_ttt_batch", "labels_from_hidden", "offline_frozen", "target_head_rows",
           "target_ttt_batch", "vocab_chunks"]

# Columns of the output head scored at once when taking the full-vocabulary argmax.
MAX_VOCAB_CHUNK = 16384

# (frozen, vocab, micro-batch [B, T]) -> TTTBatch: how a step turns a data batch into TTT inputs.
MakeInputs = Callable[[Params, VocabMap, dict[str, jax.Array]], TTTBatch]


class FeatureError(DataError):
    """Stored features that do not fit the head / draft they are used with."""


# ---------------------------------------------------------------------------------------------
# Labels from the target's final hidden state.


def target_head_rows(target_params: Params, target_cfg: TargetConfig) -> jax.Array:
    """The target's output head as [V, D] rows (the tied embedding, or lm_head transposed)."""
    if target_cfg.tie_word_embeddings:
        return target_params["embed"]
    return target_params["lm_head"].T


def vocab_chunks(vocab_size: int, max_chunk: int = MAX_VOCAB_CHUNK) -> int:
    """Smallest number of equal chunks of at most ``max_chunk`` that tile the vocabulary."""
    for n in range(1, vocab_size + 1):
        if vocab_size % n == 0 and vocab_size // n <= max_chunk:
            return n
    return vocab_size


def chunked_argmax(hidden: jax.Array, head_rows: jax.Array, max_chunk: int = MAX_VOCAB_CHUNK):
    """argmax_v hidden @ head_rows[v] for hidden [B, T, D], head_rows [V, D] -> [B, T] int32.

    Scans over vocabulary chunks keeping a running max, so at most [B, T, chunk] logits live.
    Ties resolve to the smallest id, as jnp.argmax does.
    """
    v, d = head_rows.shape
    n = vocab_chunks(v, max_chunk)
    chunks = head_rows.reshape(n, v // n, d)

    def body(carry, xs):
        best, best_id = carry
        rows, offset = xs
        logits = shard_batch(jnp.einsum("BTD,CD->BTC", hidden, rows,
                                        preferred_element_type=jnp.float32))
        local = jnp.argmax(logits, axis=-1)
        value = jnp.max(logits, axis=-1)
        better = value > best
        return (jnp.where(better, value, best), jnp.where(better, local + offset, best_id)), None

    b, t, _ = hidden.shape
    init = (jnp.full((b, t), -jnp.inf, jnp.float32), jnp.zeros((b, t), jnp.int32))
    offsets = jnp.arange(n, dtype=jnp.int32) * (v // n)
    (_, best_id), _ = jax.lax.scan(body, init, (chunks, offsets))
    return best_id


def labels_from_hidden(hidden: jax.Array, head_rows: jax.Array,
                       vocab: VocabMap) -> tuple[jax.Array, jax.Array]:
    """The TTT labels from the target's final normed hidden state [B, T, D] and head [V, D].

    Returns (target_logp [B, T, Vd] float32: log-softmax of the logits restricted to the draft
    vocabulary; target_in_draft [B, T] bool: t2d of the full-vocabulary argmax).
    """
    draft_rows = jnp.take(head_rows, vocab.draft_to_target, axis=0)  # [Vd, D]
    hidden = shard_batch(hidden)
    restricted = shard_batch(jnp.einsum("BTD,VD->BTV", hidden, draft_rows,
                                        preferred_element_type=jnp.float32))
    in_draft = vocab.t2d[chunked_argmax(hidden, head_rows)]
    return jax.nn.log_softmax(restricted, axis=-1), in_draft


def _assemble(batch: dict[str, jax.Array], taps: jax.Array, hidden: jax.Array,
              head_rows: jax.Array, vocab: VocabMap) -> TTTBatch:
    """The TTTBatch of ``batch`` (tokens, loss_mask, segment_ids, positions [B, T]) given the
    target's taps [B, T, 3D] and final hidden state [B, T, D]: the step both modes share. No
    gradient flows into the target side."""
    target_logp, in_draft = labels_from_hidden(hidden, head_rows, vocab)
    return jax.lax.stop_gradient(TTTBatch(
        tokens=batch["tokens"], taps=taps, target_logp=target_logp,
        target_in_draft=in_draft, loss_mask=jnp.asarray(batch["loss_mask"]).astype(bool),
        segment_ids=batch["segment_ids"], positions=batch["positions"],
    ))


# ---------------------------------------------------------------------------------------------
# Online: run the frozen target.


def target_ttt_batch(target_params: Params, target_cfg: TargetConfig, draft_cfg: DraftConfig,
                     vocab: VocabMap, batch: dict[str, jax.Array]) -> TTTBatch:
    """Run the frozen target on a data batch and build the TTT inputs.

    target_params: stacked layout (``param_specs``; the layers are a ``lax.scan``).
    batch: tokens, loss_mask, segment_ids, positions, each [B, T].
    """
    out = forward_stacked(target_params, target_cfg, batch["tokens"], batch["positions"],
                  packed_causal_mask(batch["segment_ids"]), tap_layers=draft_cfg.tap_layers,
                  compute_logits=False)
    return _assemble(batch, out.taps, out.hidden, target_head_rows(target_params, target_cfg),
                     vocab)


@dataclasses.dataclass(frozen=True)
class TargetInputs:
    """``make_inputs`` of online training: ``frozen`` is the target's full params, which are run
    on the batch (:func:`target_ttt_batch`). Hashable, so it can be a static jit argument."""

    target_cfg: TargetConfig
    draft_cfg: DraftConfig

    def __call__(self, frozen: Params, vocab: VocabMap, batch: dict[str, jax.Array]) -> TTTBatch:
        return target_ttt_batch(frozen, self.target_cfg, self.draft_cfg, vocab, batch)


# ---------------------------------------------------------------------------------------------
# Offline: stored features.


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
    return _assemble(batch, taps.astype(compute), hidden.astype(compute), head_rows, vocab)


@dataclasses.dataclass(frozen=True)
class FeatureInputs:
    """``make_inputs`` of offline training: ``frozen`` is :func:`offline_frozen`'s dict and each
    batch holds the stored taps and hidden states. Hashable, so it can be a static jit
    argument."""

    draft_cfg: DraftConfig

    def __call__(self, frozen: Params, vocab: VocabMap, batch: dict[str, jax.Array]) -> TTTBatch:
        return features_ttt_batch(frozen["head_rows"], self.draft_cfg, vocab, batch)
