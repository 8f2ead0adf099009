"""EAGLE-3 speculative generation: draft a tree, verify it, accept, commit; one while_loop.

Each round (all on device, static shapes, no host round trip):

  1. ``build_tree``: the draft grows a tree of ``total_tokens`` nodes from the root (the last
     token the target produced), reading its own KV cache of the committed context.
  2. ``verify_forward``: one target forward over the tree with the ancestor mask, returning
     logits and the three taps at every node.
  3. ``accept``: the longest accepted path and the target's bonus token (greedy or sampled).
  4. ``commit_path``: the accepted KV entries move to contiguous slots; the draft catches up on
     the accepted tokens with the target's taps (its cache is extended by the same count), which
     also yields the next root's draft logits.

Invariant between rounds: the target cache and the draft cache hold the same ``end`` n. The
target holds x_0..x_{n-1}; the draft holds pairs (f_s, x_{s+1}) for s < n, where x_n is the
root (already emitted, not yet fed to the target). Emitted per round: the a accepted draft
tokens and the bonus token, a + 1 tokens (the acceptance length).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from eagle3_jax.decoding.batching import bucket
from eagle3_jax.decoding.sampling import SamplingParams, sample
from eagle3_jax.decoding.tree import TreeConfig, build_tree
from eagle3_jax.decoding.verify import accept, commit_path, verify_forward
from eagle3_jax.draft.model import draft_step_cached, empty_draft_cache, fuse_taps
from eagle3_jax.draft.params import DraftHead
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import Params
from eagle3_jax.model.target import KVCache, causal_mask, prefill


@struct.dataclass
class EagleState:
    cache: KVCache  # target cache; end[b] = n
    draft_k: jax.Array  # [B, K, H, Sd]
    draft_v: jax.Array  # [B, K, Sd, H]
    root: jax.Array  # [B] last emitted token (not yet in either cache)
    root_logp: jax.Array  # [B, Vd] draft log-probs for the root's children
    root_h: jax.Array  # [B, D] draft feature at the context's last index
    tokens: jax.Array  # [B, N + W] emitted ids (-1 unused), W = depth + 1 of slack
    num_generated: jax.Array  # [B]
    done: jax.Array  # [B]
    hit_eos: jax.Array  # [B]
    rounds: jax.Array  # [B] rounds each row took part in
    accept_hist: jax.Array  # [B, W + 1] count of rounds that emitted j tokens
    step: jax.Array  # [] rounds so far (any row)
    key: jax.Array


@struct.dataclass
class EagleOutput:
    """tokens [B, max_new_tokens] (-1 padded, EOS excluded), num_generated [B], hit_eos [B],
    rounds [B] verification rounds per row, accept_hist [B, depth + 2]: rounds that emitted
    j tokens (accepted drafts + 1)."""

    tokens: jax.Array
    num_generated: jax.Array
    hit_eos: jax.Array
    rounds: jax.Array
    accept_hist: jax.Array


def _emit(state: EagleState, new_tokens: jax.Array, count: jax.Array, active: jax.Array,
          max_new_tokens: int, eos_token_ids: tuple[int, ...]) -> EagleState:
    """Append the first ``count`` [B] of ``new_tokens`` [B, W] to the output, stopping at EOS."""
    b, w = new_tokens.shape
    j = jnp.arange(w)[None, :]
    is_eos = jnp.zeros(new_tokens.shape, bool)
    for eos in eos_token_ids:
        is_eos = is_eos | (new_tokens == eos)
    first_eos = jnp.min(jnp.where(is_eos & (j < count[:, None]), j, w), axis=1)
    room = max_new_tokens - state.num_generated
    n_emit = jnp.where(active, jnp.minimum(jnp.minimum(count, first_eos), room), 0)
    dst = jnp.where(j < n_emit[:, None], state.num_generated[:, None] + j, state.tokens.shape[1])
    tokens = state.tokens.at[jnp.arange(b)[:, None], dst].set(new_tokens, mode="drop")
    num_generated = state.num_generated + n_emit
    hit_eos = state.hit_eos | (active & (first_eos < jnp.minimum(count, room)))
    done = state.done | ~active | hit_eos | (num_generated >= max_new_tokens)
    return dataclasses.replace(state, tokens=tokens, num_generated=num_generated,
                               hit_eos=hit_eos, done=done)


def _draft_extend(head: DraftHead, embed, taps, next_tokens, count, draft_k, draft_v, end):
    """The draft reads W new context entries (f_s, x_{s+1}) at slots/positions end + j.

    taps [B, W, 3D], next_tokens [B, W]; only the first ``count`` [B] are real. Returns the
    draft feature and log-probs at entry count - 1, and the updated cache.
    """
    b, w = next_tokens.shape
    positions = end[:, None] + jnp.arange(w)[None, :]
    mask = causal_mask(end, w, draft_v.shape[2])
    g = fuse_taps(head.params, taps)
    h, logits, draft_k, draft_v = draft_step_cached(
        head.params, head.cfg, jnp.take(embed, jnp.maximum(next_tokens, 0), axis=0), g,
        positions, mask, draft_k, draft_v, positions)
    last = jnp.maximum(count - 1, 0)[:, None]
    root_h = jnp.take_along_axis(h, last[:, :, None], axis=1)[:, 0]
    root_logp = jax.nn.log_softmax(jnp.take_along_axis(logits, last[:, :, None], axis=1)[:, 0])
    return root_h, root_logp, draft_k, draft_v


def _prefill(target_params, head: DraftHead, prompt_tokens, prompt_lengths, key, *, cfg,
             tree_cfg: TreeConfig, sampling, eos_token_ids, max_new_tokens, max_len):
    b, p = prompt_tokens.shape
    dcfg = head.cfg
    out = prefill(target_params, cfg, prompt_tokens, prompt_lengths, max_len,
                  tap_layers=dcfg.tap_layers)
    first = sample(jax.random.fold_in(key, 0), out.logits[:, 0], sampling)
    cache = out.cache
    last = jnp.maximum(prompt_lengths - 1, 0)[:, None]
    # Draft prefill: entry s pairs the tap f_s with x_{s+1}; the last real entry pairs with the
    # token just sampled.
    shifted = jnp.concatenate([prompt_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
    shifted = jnp.where(jnp.arange(p)[None] == last, first[:, None], shifted)
    draft_len = max_len + tree_cfg.draft_slots
    empty_k, empty_v = empty_draft_cache(dcfg, b, draft_len)
    root_h, root_logp, draft_k, draft_v = _draft_extend(
        head, target_params["embed"], out.taps, shifted, prompt_lengths, empty_k, empty_v,
        jnp.zeros((b,), jnp.int32))
    width = tree_cfg.depth + 1
    state = EagleState(
        cache=cache, draft_k=draft_k, draft_v=draft_v, root=first, root_logp=root_logp,
        root_h=root_h, tokens=jnp.full((b, max_new_tokens + width), -1, jnp.int32),
        num_generated=jnp.zeros((b,), jnp.int32), done=jnp.zeros((b,), bool),
        hit_eos=jnp.zeros((b,), bool), rounds=jnp.zeros((b,), jnp.int32),
        accept_hist=jnp.zeros((b, width + 1), jnp.int32), step=jnp.zeros((), jnp.int32), key=key)
    active = prompt_lengths > 0
    state = _emit(state, first[:, None], jnp.ones((b,), jnp.int32), active, max_new_tokens,
                  eos_token_ids)
    # A prompt that leaves no room for one tree stops after the prefill token (as _round does).
    full = state.cache.end + tree_cfg.total_tokens + width > max_len
    return dataclasses.replace(state, done=state.done | full)


def draft_proposer(target_params, head: DraftHead, state: EagleState, cfg: TargetConfig,
                   tree_cfg: TreeConfig):
    """The EAGLE-3 head's dynamic tree (the default ``proposer`` of a round)."""
    return build_tree(head.params, head.cfg, head.vocab, target_params["embed"], tree_cfg,
                      state.root, state.root_logp, state.root_h, state.draft_k, state.draft_v,
                      state.cache.end)


def _round(target_params, head: DraftHead, state: EagleState, *, cfg: TargetConfig,
           tree_cfg: TreeConfig, sampling, eos_token_ids, max_new_tokens,
           proposer=draft_proposer) -> EagleState:
    """One draft-verify-accept-commit round for every row that is not done.

    ``proposer(target_params, head, state, cfg, tree_cfg) -> DraftTree`` makes the tree; tests
    substitute oracles (a draft that knows the target's continuation) to exercise acceptance.
    """
    b = state.root.shape[0]
    rows = jnp.arange(b)[:, None]
    active = ~state.done
    end = state.cache.end
    embed = target_params["embed"]
    tree = proposer(target_params, head, state, cfg, tree_cfg)
    logits, cache, taps = verify_forward(target_params, cfg, tree, state.cache,
                                         head.cfg.tap_layers)
    step = state.step + 1
    acc = accept(jax.random.fold_in(state.key, step), tree, logits, sampling, tree_cfg.top_k)
    cache = commit_path(cache, acc.path, active)
    count = acc.num_accepted + 1  # accepted drafts + the bonus token
    # Emitted this round: path tokens after the root, then the bonus token.
    path_tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(acc.path, 0), axis=1)  # [B, W]
    width = acc.path.shape[1]
    j = jnp.arange(width)[None, :]
    following = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
    new_tokens = jnp.where(j < acc.num_accepted[:, None], following,
                           jnp.where(j == acc.num_accepted[:, None], acc.bonus[:, None], -1))
    path_taps = jnp.take_along_axis(taps, jnp.maximum(acc.path, 0)[:, :, None], axis=1)
    root_h, root_logp, draft_k, draft_v = _draft_extend(
        head, embed, path_taps, new_tokens, count, state.draft_k, state.draft_v, end)
    keep = active[:, None]
    state = dataclasses.replace(
        state, cache=cache, draft_k=draft_k, draft_v=draft_v,
        root=jnp.where(active, acc.bonus, state.root),
        root_logp=jnp.where(keep, root_logp, state.root_logp),
        root_h=jnp.where(keep, root_h, state.root_h),
        rounds=state.rounds + active.astype(jnp.int32),
        accept_hist=state.accept_hist.at[rows[:, 0], count].add(active.astype(jnp.int32)),
        step=step)
    state = _emit(state, new_tokens, count, active, max_new_tokens, eos_token_ids)
    # A row stops when the next tree would not fit in its target cache.
    full = state.cache.end + tree_cfg.total_tokens + width > state.cache.max_len
    return dataclasses.replace(state, done=state.done | full)


_STATIC = ("cfg", "tree_cfg", "sampling", "eos_token_ids", "max_new_tokens", "max_len",
           "proposer")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _generate_jit(target_params, head, prompt_tokens, prompt_lengths, key, *, cfg, tree_cfg,
                  sampling, eos_token_ids, max_new_tokens, max_len,
                  proposer=draft_proposer) -> EagleOutput:
    state = _prefill(target_params, head, prompt_tokens, prompt_lengths, key, cfg=cfg,
                     tree_cfg=tree_cfg, sampling=sampling, eos_token_ids=eos_token_ids,
                     max_new_tokens=max_new_tokens, max_len=max_len)
    body = functools.partial(_round, target_params, head, cfg=cfg, tree_cfg=tree_cfg,
                             sampling=sampling, eos_token_ids=eos_token_ids,
                             max_new_tokens=max_new_tokens, proposer=proposer)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    return EagleOutput(tokens=state.tokens[:, :max_new_tokens],
                       num_generated=state.num_generated, hit_eos=state.hit_eos,
                       rounds=state.rounds, accept_hist=state.accept_hist)


def eagle_cache_size(cfg: TargetConfig, prompt_width: int, max_new_tokens: int,
                     tree_cfg: TreeConfig) -> int:
    """Target KV slots: prompt + new tokens + one tree + one round of slack, bucketed and capped
    at the model context (as plain decoding does: a row that fills the context stops there).

    Raises ValueError when not even the prompt and one tree fit the context.
    """
    tree_room = tree_cfg.total_tokens + tree_cfg.depth + 2
    context = cfg.max_position_embeddings
    if prompt_width + tree_room > context:
        raise ValueError(
            f"prompt of {prompt_width} tokens + one draft tree ({tree_room} slots) exceeds the "
            f"model context of {context} tokens; shorten the prompt or use a smaller tree")
    return min(bucket(prompt_width + max_new_tokens + tree_room), context)


def generate_eagle(
    target_params: Params,
    cfg: TargetConfig,
    head: DraftHead,
    prompt_tokens,
    prompt_lengths,
    *,
    max_new_tokens: int,
    tree: TreeConfig = TreeConfig(),
    sampling: SamplingParams = SamplingParams(),
    key: jax.Array | None = None,
    eos_token_ids: Sequence[int] = (),
    max_len: int | None = None,
    proposer=draft_proposer,
) -> EagleOutput:
    """Speculative generation with an EAGLE-3 head, one jitted call (see module docstring).

    Args mirror :func:`eagle3_jax.decoding.generate`; ``tree`` sets the draft tree shape.
    Output tokens equal plain decoding's for greedy sampling, and follow the target's exact
    distribution otherwise.
    """
    head.cfg.check_fits(cfg)
    tokens = jnp.asarray(prompt_tokens, jnp.int32)
    lengths = jnp.asarray(prompt_lengths, jnp.int32)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_len is None:
        max_len = eagle_cache_size(cfg, tokens.shape[1], max_new_tokens, tree)
    key = jax.random.PRNGKey(0) if key is None else key
    return _generate_jit(target_params, head, tokens, lengths, key, cfg=cfg, tree_cfg=tree,
                         sampling=sampling, eos_token_ids=tuple(int(e) for e in eos_token_ids),
                         max_new_tokens=int(max_new_tokens), max_len=int(max_len),
                         proposer=proposer)


_STEP_STATIC = ("cfg", "tree_cfg", "sampling", "eos_token_ids", "max_new_tokens")
_prefill_jit = jax.jit(_prefill, static_argnames=_STEP_STATIC + ("max_len",))
_round_jit = jax.jit(_round, static_argnames=_STEP_STATIC + ("proposer",),
                     donate_argnames=("state",))


def _eagle_args(cfg, head, prompt_tokens, prompt_lengths, max_new_tokens, tree, eos_token_ids,
                max_len):
    head.cfg.check_fits(cfg)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    tokens = jnp.asarray(prompt_tokens, jnp.int32)
    if max_len is None:
        max_len = eagle_cache_size(cfg, tokens.shape[1], max_new_tokens, tree)
    return (tokens, jnp.asarray(prompt_lengths, jnp.int32), int(max_len),
            tuple(int(e) for e in eos_token_ids))


def compile_generate_eagle(target_params, cfg: TargetConfig, head: DraftHead, prompt_tokens,
                           prompt_lengths, *, max_new_tokens: int, tree: TreeConfig = TreeConfig(),
                           sampling: SamplingParams = SamplingParams(),
                           eos_token_ids: Sequence[int] = (), max_len: int | None = None
                           ) -> Callable[..., EagleOutput]:
    """Compile :func:`generate_eagle` ahead of time for these shapes (compilation timed apart).

    Returns ``run(target_params, head, prompt_tokens, prompt_lengths, key) -> EagleOutput``.
    """
    tokens, lengths, max_len, eos = _eagle_args(cfg, head, prompt_tokens, prompt_lengths,
                                                max_new_tokens, tree, eos_token_ids, max_len)
    compiled = _generate_jit.lower(
        target_params, head, tokens, lengths, jax.random.PRNGKey(0), cfg=cfg, tree_cfg=tree,
        sampling=sampling, eos_token_ids=eos, max_new_tokens=int(max_new_tokens),
        max_len=max_len).compile()

    def run(target_params, head, prompt_tokens, prompt_lengths, key) -> EagleOutput:
        return compiled(target_params, head, jnp.asarray(prompt_tokens, jnp.int32),
                        jnp.asarray(prompt_lengths, jnp.int32), key)

    return run


def generate_eagle_stream(target_params, cfg: TargetConfig, head: DraftHead, prompt_tokens,
                          prompt_lengths, *, max_new_tokens: int, tree: TreeConfig = TreeConfig(),
                          sampling: SamplingParams = SamplingParams(),
                          key: jax.Array | None = None, eos_token_ids: Sequence[int] = (),
                          max_len: int | None = None) -> Iterator[list[np.ndarray]]:
    """Like :func:`generate_eagle`, but yields after the prefill and after every round.

    Each item holds, per row, the int32 tokens emitted in that step (empty when none). The same
    ``_prefill`` and ``_round`` run (jitted apart), with the same keys, so the tokens equal
    :func:`generate_eagle`'s for the same ``key``.
    """
    tokens, lengths, max_len, eos = _eagle_args(cfg, head, prompt_tokens, prompt_lengths,
                                                max_new_tokens, tree, eos_token_ids, max_len)
    key = jax.random.PRNGKey(0) if key is None else key
    static = dict(cfg=cfg, tree_cfg=tree, sampling=sampling, eos_token_ids=eos,
                  max_new_tokens=int(max_new_tokens))
    state = _prefill_jit(target_params, head, tokens, lengths, key, max_len=max_len, **static)
    produced = np.zeros(tokens.shape[0], np.int64)
    while True:
        out, count, done = jax.device_get((state.tokens, state.num_generated, state.done))
        yield [out[i, produced[i]:count[i]] for i in range(out.shape[0])]
        produced = count.astype(np.int64)
        if done.all():
            return
        state = _round_jit(target_params, head, state, **static)
