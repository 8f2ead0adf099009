"""The jitted training step: frozen inputs -> TTT batch -> draft loss -> AdamW update.

One step function serves online and offline training. It takes ``frozen``, a pytree of frozen
target arrays that holds at least ``"embed"`` (the draft reads its input tokens from the
target's embedding table), and a static ``make_inputs(frozen, vocab, micro_batch) -> TTTBatch``
(``train/inputs.py``): ``TargetInputs`` runs the target inside the step (online),
``FeatureInputs`` reads stored taps and hidden states from the batch (offline).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.params import VocabMap
from eagle3_jax.draft.ttt import ttt_forward
from eagle3_jax.model.params import Params
from eagle3_jax.train.inputs import MakeInputs

# Top-r hit rates measured at eval, r = 1..EVAL_HIT_RANKS: enough for a tree of tree_top_k 10.
EVAL_HIT_RANKS = 10


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


def _cast(params: Params, compute_dtype: str | None, draft_cfg: DraftConfig) -> Params:
    """The draft's (master) params in the dtype it computes in (None: the params' own)."""
    dtype = jnp.dtype(compute_dtype or draft_cfg.dtype)
    return jax.tree.map(lambda x: x.astype(dtype), params)


def train_step(state: TrainState, frozen: Params, vocab: VocabMap,
               batch: dict[str, jax.Array], *, make_inputs: MakeInputs,
               draft_cfg: DraftConfig, optimizer: optax.GradientTransformation,
               compute_dtype: str | None = None, loss_mask: str = "predicted",
               objective: str = "kl"):
    """One optimiser step over ``batch`` of shape [A, B, T, ...] (A micro-batches accumulated).

    Args:
      frozen: frozen target arrays holding ``"embed"``, read by ``make_inputs`` (module doc).
      make_inputs: static; builds each micro-batch's TTTBatch (TargetInputs / FeatureInputs).
      compute_dtype: the dtype the draft computes in (params are cast to it for the forward;
        the master params and the optimiser moments keep theirs, float32 in training).
      loss_mask: "predicted" or "reference" (``eagle3_jax.draft.ttt``).
      objective: "kl" or "lk", the per-position loss (``eagle3_jax.draft.ttt``).
    Returns (new_state, metrics) with the weighted loss and per-step loss / accuracy averaged
    over micro-batches.
    """
    embed = frozen["embed"]

    def micro_loss(params, micro):
        ttt = make_inputs(frozen, vocab, micro)
        return ttt_forward(_cast(params, compute_dtype, draft_cfg), draft_cfg, embed, ttt,
                           loss_mask=loss_mask, objective=objective)

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
              *, make_inputs: MakeInputs, draft_cfg: DraftConfig,
              compute_dtype: str | None = None, loss_mask: str = "predicted",
              hit_ranks: int = EVAL_HIT_RANKS, objective: str = "kl"):
    """Held-out loss, per-step accuracy and per-step top-1..``hit_ranks`` hit rates
    (``hits_per_step`` [K, R]) on one [B, T, ...] batch (no update)."""
    ttt = make_inputs(frozen, vocab, batch)
    loss, metrics = ttt_forward(_cast(params, compute_dtype, draft_cfg), draft_cfg,
                                frozen["embed"], ttt, loss_mask=loss_mask, hit_ranks=hit_ranks,
                                objective=objective)
    metrics["loss"] = loss
    return metrics
