"""The jitted training step: frozen inputs -> TTT batch -> draft loss -> AdamW update.

One step function serves online and offline training. It takes ``frozen``, a pytree of frozen
target arrays that holds at least ``"embed"`` (the draft reads its input tokens from the
target's embedding table), and a static ``make_inputs(frozen, vocab, micro_batch) -> TTTBatch``:

    online   frozen = the target's full params, make_inputs = TargetInputs: runs the target
             inside the jitted step (no gradient) for the taps and labels;
    offline  frozen = {"embed", "head_rows"}, make_inputs = train.offline.FeatureInputs: the
             batch already holds the stored taps and final hidden states, the labels need
             only the output head.

Either way the labels are, per position, the target's log-probabilities restricted to the draft
vocabulary and whether its full-vocabulary argmax lies in the draft vocabulary
(:func:`labels_from_hidden`). Full-vocabulary float32 logits for a whole batch are never
materialised: the restricted logits use only the Vd head columns, and the argmax runs over
vocabulary chunks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.params import VocabMap
from eagle3_jax.draft.ttt import TTTBatch, ttt_forward
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import Params
from eagle3_jax.model.target import forward

# Columns of the output head scored at once when taking the full-vocabulary argmax.
MAX_VOCAB_CHUNK = 16384


def _head_columns(target_params: Params, cfg: TargetConfig) -> jax.Array:
    """The output head as [V, D] rows (the tied embedding, or lm_head transposed)."""
    if cfg.tie_word_embeddings:
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
        logits = jnp.einsum("BTD,CD->BTC", hidden, rows, preferred_element_type=jnp.float32)
        local = jnp.argmax(logits, axis=-1)
        value = jnp.max(logits, axis=-1)
        better = value > best
        return (jnp.where(better, value, best), jnp.where(better, local + offset, best_id)), None

    b, t, _ = hidden.shape
    init = (jnp.full((b, t), -jnp.inf, jnp.float32), jnp.zeros((b, t), jnp.int32))
    offsets = jnp.arange(n, dtype=jnp.int32) * (v // n)
    (_, best_id), _ = jax.lax.scan(body, init, (chunks, offsets))
    return best_id


def packed_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, T] segment ids (0 = padding) -> [B, T, T] causal mask within each document."""
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))[None]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal & same & (segment_ids[:, :, None] > 0)


def labels_from_hidden(hidden: jax.Array, head_rows: jax.Array,
                       vocab: VocabMap) -> tuple[jax.Array, jax.Array]:
    """The TTT labels from the target's final normed hidden state [B, T, D] and head [V, D].

    Returns (target_logp [B, T, Vd] float32: log-softmax of the logits restricted to the draft
    vocabulary; target_in_draft [B, T] bool: t2d of the full-vocabulary argmax). Shared by
    online training (:func:`target_ttt_batch`) and offline features (``train/offline.py``).
    """
    draft_rows = jnp.take(head_rows, vocab.draft_to_target, axis=0)  # [Vd, D]
    restricted = jnp.einsum("BTD,VD->BTV", hidden, draft_rows,
                            preferred_element_type=jnp.float32)
    in_draft = vocab.t2d[chunked_argmax(hidden, head_rows)]
    return jax.nn.log_softmax(restricted, axis=-1), in_draft


def target_ttt_batch(target_params: Params, target_cfg: TargetConfig, draft_cfg: DraftConfig,
                     vocab: VocabMap, batch: dict[str, jax.Array]) -> TTTBatch:
    """Run the frozen target on a data batch and build the TTT inputs.

    batch: tokens, loss_mask, segment_ids, positions, each [B, T].
    """
    tokens, segments, positions = batch["tokens"], batch["segment_ids"], batch["positions"]
    out = forward(target_params, target_cfg, tokens, positions, packed_causal_mask(segments),
                  tap_layers=draft_cfg.tap_layers, compute_logits=False)
    head_rows = _head_columns(target_params, target_cfg)
    target_logp, in_draft = labels_from_hidden(out.hidden, head_rows, vocab)
    return jax.lax.stop_gradient(TTTBatch(
        tokens=tokens, taps=out.taps, target_logp=target_logp,
        target_in_draft=in_draft, loss_mask=batch["loss_mask"].astype(bool),
        segment_ids=segments, positions=positions,
    ))


# (frozen, vocab, micro-batch [B, T]) -> TTTBatch: how a step turns a data batch into TTT inputs.
MakeInputs = Callable[[Params, VocabMap, dict[str, jax.Array]], TTTBatch]


@dataclasses.dataclass(frozen=True)
class TargetInputs:
    """``make_inputs`` of online training: ``frozen`` is the target's full params, which are run
    on the batch (:func:`target_ttt_batch`). Hashable, so it can be a static jit argument."""

    target_cfg: TargetConfig
    draft_cfg: DraftConfig

    def __call__(self, frozen: Params, vocab: VocabMap, batch: dict[str, jax.Array]) -> TTTBatch:
        return target_ttt_batch(frozen, self.target_cfg, self.draft_cfg, vocab, batch)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warm-up and cosine decay; clip by global norm (reference §4)."""

    learning_rate: float = 1e-4
    warmup_steps: int = 100
    total_steps: int = 10000
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    min_lr_ratio: float = 0.0

    def schedule(self) -> optax.Schedule:
        """Learning rate by step: linear warm-up to the peak, cosine decay to the end."""
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=self.learning_rate,
            warmup_steps=max(self.warmup_steps, 1),
            decay_steps=max(self.total_steps, self.warmup_steps + 1),
            end_value=self.learning_rate * self.min_lr_ratio,
        )

    def build(self) -> optax.GradientTransformation:
        return optax.chain(
            optax.clip_by_global_norm(self.grad_clip),
            optax.adamw(self.schedule(), b1=self.b1, b2=self.b2,
                        weight_decay=self.weight_decay),
        )


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Params
    opt_state: Any
    rng: jax.Array

    @classmethod
    def create(cls, params: Params, optimizer: optax.GradientTransformation, rng: jax.Array):
        return cls(step=jnp.zeros((), jnp.int32), params=params,
                   opt_state=optimizer.init(params), rng=rng)


def train_step(state: TrainState, frozen: Params, vocab: VocabMap,
               batch: dict[str, jax.Array], *, make_inputs: MakeInputs,
               draft_cfg: DraftConfig, optimizer: optax.GradientTransformation,
               compute_dtype: str | None = None):
    """One optimiser step over ``batch`` of shape [A, B, T, ...] (A micro-batches accumulated).

    Args:
      frozen: frozen target arrays holding ``"embed"``, read by ``make_inputs`` (module doc).
      make_inputs: static; builds each micro-batch's TTTBatch (TargetInputs / FeatureInputs).
    Returns (new_state, metrics) with the weighted loss and per-step loss / accuracy averaged
    over micro-batches.
    """
    dtype = jnp.dtype(compute_dtype or draft_cfg.dtype)
    embed = frozen["embed"]

    def micro_loss(params, micro):
        ttt = make_inputs(frozen, vocab, micro)
        cast = jax.tree.map(lambda x: x.astype(dtype), params)
        return ttt_forward(cast, draft_cfg, embed, ttt)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def accumulate(carry, micro):
        grads, loss, metrics = carry
        (l, m), g = grad_fn(state.params, micro)
        grads = jax.tree.map(jnp.add, grads, g)
        metrics = jax.tree.map(jnp.add, metrics, m)
        return (grads, loss + l, metrics), None

    num_micro = batch["tokens"].shape[0]
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    k = draft_cfg.ttt_steps
    zero_metrics = {name: jnp.zeros((k,), jnp.float32)
                    for name in ("loss_per_step", "acc_per_step", "weight_per_step")}
    (grads, loss, metrics), _ = jax.lax.scan(accumulate, (zeros, jnp.zeros(()), zero_metrics),
                                             batch)
    grads = jax.tree.map(lambda g: g / num_micro, grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {name: value / num_micro for name, value in metrics.items()}
    metrics["loss"] = loss / num_micro
    metrics["grad_norm"] = optax.tree.norm(grads)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics


def eval_step(params: Params, frozen: Params, vocab: VocabMap, batch: dict[str, jax.Array],
              *, make_inputs: MakeInputs, draft_cfg: DraftConfig):
    """Held-out loss and per-step accuracy on one [B, T, ...] batch (no update)."""
    ttt = make_inputs(frozen, vocab, batch)
    loss, metrics = ttt_forward(params, draft_cfg, frozen["embed"], ttt)
    metrics["loss"] = loss
    return metrics


def simulated_accept_length(acc_per_step) -> float:
    """1 + sum_k prod_{i<=k} acc_i: expected tokens per round for a chain of len(acc) drafts."""
    total, running = 1.0, 1.0
    for a in acc_per_step:
        running *= float(a)
        total += running
    return total
