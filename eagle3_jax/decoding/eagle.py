"""EAGLE-3 speculative generation: draft a tree, verify it, accept, commit; one while_loop.

Each round (all on device, static shapes, no host round trip):

  1. ``build_tree``: the draft grows a tree of ``total_tokens`` nodes from the root (the last
     token the target produced), reading its own KV cache of the committed context.
  2. ``verify_forward``: one target forward over the tree with the ancestor mask, returning
     logits and the three taps at every node.
  3. ``accept``: the longest accepted path and the target's bonus token (greedy or sampled).
  4. ``commit_path``: the accepted path's KV entries are written at contiguous slots (the
     verification forward writes none); the draft catches up on the accepted tokens with the
     target's taps (its cache is extended by the same count), which also yields the next root's
     draft logits.

Invariant between rounds: the target cache and the draft cache hold the same ``end`` n. The
target holds x_0..x_{n-1}; the draft holds pairs (f_s, x_{s+1}) for s < n, where x_n is the
root (already emitted, not yet fed to the target). Emitted per round: the a accepted draft
tokens and the bonus token, a + 1 tokens (the acceptance length).

With a :class:`Fallback` the loop measures what it is paying for: at round ``probe_rounds`` of a
probe (drafting's start, or a resume) and every power of two after it, when the tokens emitted
per round in the probe (over all live rows) fall
below ``break_even`` (one round's measured cost in decode steps) by more than their standard
error (``FALLBACK_STANDARD_ERRORS``: an answer's first tokens are its hardest to draft, so a
few probe rounds just under break-even are not evidence enough), it stops drafting and the
steps are plain decode steps (the target's forward of the root, the same function plain
decoding runs, in a loop of its own: ``EagleDecoding.phases``), for the whole batch. Each keeps
its draft entry (the root's taps, the token it emitted); every ``resume_window`` of them the
draft reads them in one forward (``_catch_up``), scoring its top-1 against the tokens the
target emitted, and where that hit rate says drafting pays again (:meth:`Fallback.resumes`)
the rounds resume with a new probe. Answers get easier to draft as they go (an answer's first
128 tokens drafted at 0.64 top-1, the next 128 at 0.89: the shipped head, 2026-12-05), so a
give-up is not for good. The output stays exactly the target's throughout (greedy: identical to
plain decoding; sampled: the target's distribution).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from eagle3_jax.decoding import driver
from eagle3_jax.decoding.batching import bucket
from eagle3_jax.decoding.driver import (Emitted, GenerationError, append_tokens, check_prompts,
                                        eos_tuple)
from eagle3_jax.decoding.generate import PlainDecoding, decode_step
from eagle3_jax.decoding.sampling import SamplingParams, sample
from eagle3_jax.decoding.tree import TreeConfig, build_tree
from eagle3_jax.decoding.verify import accept, commit_path, verify_forward
from eagle3_jax.draft.model import draft_step_cached, empty_draft_cache, fuse_taps
from eagle3_jax.draft.params import DraftHead
from eagle3_jax.kernels.matmul import weight_rows
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.layers import resize_kv
from eagle3_jax.model.params import Params
from eagle3_jax.model.target import KVCache, causal_mask, prefill


PROBE_ROUNDS = 8  # the fallback's first check (tokens per round are noisy before that)
# The fallback gives up only where the tokens per round so far, plus this many of their standard
# errors, are below break-even. With 0 the demo's prompt gave up after 8 rounds at 1.25 tokens a
# round against a break-even of 1.29 (a 2-core AVX2-only AMD EPYC, 2026-12-05): within one
# standard error (0.15) of it.
FALLBACK_STANDARD_ERRORS = 1.0
# After giving up, the draft reads the plain steps' taps every this many steps (one catch-up
# forward, its output at every entry) and drafting resumes where its top-1 would have paid.
RESUME_WINDOW = 32
# Of those, the last this many are scored (the draft's output head at each: ~0.2 ms an entry on
# a 2-core CPU, so scoring all 32 would cost about 1% of the plain steps it follows).
RESUME_SCORED = 16


@dataclasses.dataclass(frozen=True)
class Fallback:
    """When EAGLE gives up drafting (module docstring).

    break_even: tokens a round must emit to beat plain decoding, i.e. a round's cost over a
      decode step's (measured: :func:`eagle3_jax.decoding.autotune.fallback_for`).
    probe_rounds: the first check; later checks at every power of two after it.
    resume_window: after giving up, the draft catches up on the plain steps' taps every this
      many steps and drafting resumes (a new probe) where :meth:`resumes` says so; 0: the
      give-up is for good.
    """

    break_even: float
    probe_rounds: int = PROBE_ROUNDS
    resume_window: int = RESUME_WINDOW

    def __post_init__(self):
        if self.probe_rounds < 1:
            raise ValueError(f"probe_rounds must be >= 1, got {self.probe_rounds}")
        if self.resume_window < 0 or self.resume_window == 1:
            raise ValueError(f"resume_window must be 0 (never resume) or >= 2, got "
                             f"{self.resume_window}")

    def gives_up(self, step, rounds, accept_hist):
        """[] bool: check now (``step``, the rounds since this probe began, a power of two >=
        probe_rounds) and the measured tokens per round (``accept_hist`` [B, W + 1] over
        ``rounds`` [B], this probe's), plus ``FALLBACK_STANDARD_ERRORS`` of their standard
        errors, are below break-even."""
        checkpoint = (step >= self.probe_rounds) & ((step & (step - 1)) == 0)
        j = jnp.arange(accept_hist.shape[1], dtype=jnp.float32)[None, :]
        n = jnp.maximum(jnp.sum(rounds), 1).astype(jnp.float32)
        mean = jnp.sum(accept_hist * j) / n
        variance = jnp.maximum(jnp.sum(accept_hist * j * j) / n - mean * mean, 0.0)
        upper = mean + FALLBACK_STANDARD_ERRORS * jnp.sqrt(variance / n)
        return checkpoint & (upper < self.break_even)

    def resumes(self, hits, seen, depth: int):
        """[] bool: drafting would pay again. ``hits`` / ``seen`` [B]: of the tokens the plain
        steps emitted, those the draft's top-1 predicted from the target's taps (its depth-1
        hit, teacher forced). The hit rate, less ``FALLBACK_STANDARD_ERRORS`` of its standard
        error, as a chain's acceptance (1 + h + ... + h^depth tokens a round: a tree's top-1
        path) must reach break-even; the new probe then measures the tree itself."""
        n = jnp.sum(seen).astype(jnp.float32)
        h = jnp.sum(hits) / jnp.maximum(n, 1.0)
        low = jnp.clip(h - FALLBACK_STANDARD_ERRORS * jnp.sqrt(h * (1 - h) / jnp.maximum(n, 1.0)),
                       0.0, 1.0)
        chain = jnp.sum(low ** jnp.arange(depth + 1, dtype=jnp.float32))
        return (n > 0) & (chain >= self.break_even)


@struct.dataclass
class EagleState:
    cache: KVCache  # target cache; end[b] = n
    draft_k: jax.Array  # [B, K, H, Sd]
    draft_v: jax.Array  # [B, K, Sd, H]
    root: jax.Array  # [B] last emitted token (not yet in either cache)
    root_logp: jax.Array  # [B, Vd] draft log-probs for the root's children
    root_h: jax.Array  # [B, D] draft feature at the context's last index
    out: Emitted  # emitted tokens [B, N] and stop flags
    rounds: jax.Array  # [B] rounds each row took part in
    accept_hist: jax.Array  # [B, W + 1] count of rounds that emitted j tokens
    step: jax.Array  # [] rounds and plain steps so far (any row)
    key: jax.Array
    plain: jax.Array  # [] bool: gave up drafting (Fallback); the steps are plain
    plain_steps: jax.Array  # [B] plain decode steps each row took part in
    # The fallback's probe (rounds since drafting began or resumed) and the draft's catch-up:
    probe_step: jax.Array  # [] step when the probe began
    probe_rounds: jax.Array  # [B] rounds before it
    probe_hist: jax.Array  # [B, W + 1] accept_hist before it
    stale: jax.Array  # [B] plain steps the draft has not read (their entries below)
    stale_taps: jax.Array  # [B, R, 3D] tap f_s of each (R: Fallback.resume_window, or 0)
    stale_tokens: jax.Array  # [B, R] and x_{s+1}, the token it emitted
    resumes: jax.Array  # [B] times drafting resumed after a give-up


@struct.dataclass
class EagleOutput:
    """tokens [B, max_new_tokens] (-1 padded, EOS excluded), num_generated [B], hit_eos [B],
    rounds [B] verification rounds per row, accept_hist [B, depth + 2]: rounds that emitted
    j tokens (accepted drafts + 1, less an EOS or tokens past max_new_tokens), plain_steps [B]:
    plain decode steps after a :class:`Fallback` gave up drafting (one token each), resumes
    [B]: times drafting resumed after that."""

    tokens: jax.Array
    num_generated: jax.Array
    hit_eos: jax.Array
    rounds: jax.Array
    accept_hist: jax.Array
    plain_steps: jax.Array
    resumes: jax.Array


def _draft_extend(head: DraftHead, embed, taps, next_tokens, count, draft_k, draft_v, end,
                  scored: int = 0):
    """The draft reads W new context entries (f_s, x_{s+1}) at slots/positions end + j.

    taps [B, W, 3D], next_tokens [B, W]; only the first ``count`` [B] are real. Returns the
    draft feature and log-probs at entry count - 1, the updated cache, and the draft's logits
    [B, scored, Vd] at the ``scored`` entries before that one (entry count - 1 - scored + i;
    those before entry 0 are entry 0's).
    """
    b, w = next_tokens.shape
    positions = end[:, None] + jnp.arange(w)[None, :]
    mask = causal_mask(end, w, draft_v.shape[2])
    g = fuse_taps(head.params, head.cfg, taps)
    at = (count - 1 - scored)[:, None] + jnp.arange(scored + 1)[None, :]  # [B, scored + 1]
    h, logits, draft_k, draft_v = draft_step_cached(
        head.params, head.cfg, weight_rows(embed, jnp.maximum(next_tokens, 0)), g,
        positions, mask, draft_k, draft_v, positions, outputs_at=jnp.maximum(at, 0))
    return (h[:, scored], jax.nn.log_softmax(logits[:, scored]), draft_k, draft_v,
            logits[:, :scored])


@struct.dataclass
class EagleCaches:
    """What an EAGLE call leaves for a later one (:meth:`EagleDecoding.reusable`): the target's
    cache and the draft's, whose entries [0, draft_end) [B] are up to date (entry s pairs the
    tap f_s with x_{s+1}; the draft stops moving once a fallback gives up drafting)."""

    cache: KVCache
    draft_k: jax.Array  # [B, K, H, S']
    draft_v: jax.Array  # [B, K, S', H]
    draft_end: jax.Array  # [B]


def _prefill(target_params, head: DraftHead, prompt_tokens, prompt_lengths, key, *, cfg,
             tree_cfg: TreeConfig, sampling, eos_token_ids, max_new_tokens, max_len,
             resume_window: int = 0, prefix: driver.Prefix | None = None):
    b, p = prompt_tokens.shape
    dcfg = head.cfg
    # A catch-up writes resume_window entries (the stale ones and padding) from before `end`.
    draft_len = max_len + max(tree_cfg.draft_slots, resume_window)
    if prefix is None:
        start = jnp.zeros((b,), jnp.int32)
        cache, (draft_k, draft_v) = None, empty_draft_cache(dcfg, b, draft_len)
    else:  # the first `start` prompt tokens are in both caches (EagleDecoding.reuse_start)
        start = prefix.start.astype(jnp.int32)
        cache = prefix.caches.cache.resized(max_len).replace(end=start)
        draft_k, draft_v = resize_kv(prefix.caches.draft_k, prefix.caches.draft_v, draft_len)
    out = prefill(target_params, cfg, prompt_tokens, prompt_lengths, max_len,
                  tap_layers=dcfg.tap_layers, prefix=cache)
    first = sample(jax.random.fold_in(key, 0), out.logits[:, 0], sampling)
    cache = out.cache
    last = jnp.maximum(prompt_lengths - 1, 0)[:, None]
    # Draft prefill: entry s pairs the tap f_s with x_{s+1}; the last real entry pairs with the
    # token just sampled. Entries from `start` on are new: index j below is entry start + j.
    shifted = jnp.concatenate([prompt_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
    shifted = jnp.where(jnp.arange(p)[None] == last, first[:, None], shifted)
    taps = out_taps = out.taps
    if prefix is not None:
        entries = jnp.minimum(start[:, None] + jnp.arange(p)[None], p - 1)  # [B, P]
        shifted = jnp.take_along_axis(shifted, entries, axis=1)
        taps = jnp.take_along_axis(taps, entries[:, :, None], axis=1)
    root_h, root_logp, draft_k, draft_v, _ = _draft_extend(
        head, target_params["embed"], taps, shifted, prompt_lengths - start, draft_k, draft_v,
        start)
    width = tree_cfg.depth + 1
    out = append_tokens(Emitted.empty(b, max_new_tokens), first[:, None],
                        jnp.ones((b,), jnp.int32), prompt_lengths > 0, eos_token_ids)
    # A prompt that leaves no room for one tree stops after the prefill token (as _round does).
    out = out.stop_where(cache.end + tree_cfg.total_tokens + width > max_len)
    zeros = jnp.zeros((b,), jnp.int32)
    return EagleState(
        cache=cache, draft_k=draft_k, draft_v=draft_v, root=first, root_logp=root_logp,
        root_h=root_h, out=out, rounds=zeros, accept_hist=jnp.zeros((b, width + 1), jnp.int32),
        step=jnp.zeros((), jnp.int32), key=key, plain=jnp.zeros((), bool), plain_steps=zeros,
        probe_step=jnp.zeros((), jnp.int32), probe_rounds=zeros,
        probe_hist=jnp.zeros((b, width + 1), jnp.int32), stale=zeros,
        stale_taps=jnp.zeros((b, resume_window, out_taps.shape[-1]), out_taps.dtype),
        stale_tokens=jnp.zeros((b, resume_window), jnp.int32), resumes=zeros)


def draft_proposer(target_params, head: DraftHead, state: EagleState, cfg: TargetConfig,
                   tree_cfg: TreeConfig):
    """The EAGLE-3 head's dynamic tree (the default ``proposer`` of a round), with the draft
    caches it wrote its frontiers into (:func:`eagle3_jax.decoding.tree.build_tree`)."""
    return build_tree(head.params, head.cfg, head.vocab, target_params["embed"], tree_cfg,
                      state.root, state.root_logp, state.root_h, state.draft_k, state.draft_v,
                      state.cache.end)


def _round(target_params, head: DraftHead, state: EagleState, *, cfg: TargetConfig,
           tree_cfg: TreeConfig, sampling, eos_token_ids, proposer=draft_proposer) -> EagleState:
    """One draft-verify-accept-commit round for every row that is not done.

    ``proposer(target_params, head, state, cfg, tree_cfg) -> (DraftTree, draft_k, draft_v)``
    makes the tree and returns the draft caches to go on from (their slots from ``end`` on are
    scratch); tests substitute oracles (a draft that knows the target's continuation, caches
    untouched) to exercise acceptance.
    """
    b = state.root.shape[0]
    rows = jnp.arange(b)[:, None]
    active = ~state.out.done
    end = state.cache.end
    embed = target_params["embed"]
    tree, draft_k, draft_v = proposer(target_params, head, state, cfg, tree_cfg)
    logits, new_kv, taps = verify_forward(target_params, cfg, tree, state.cache,
                                          head.cfg.tap_layers)
    step = state.step + 1
    acc = accept(jax.random.fold_in(state.key, step), tree, logits, sampling, tree_cfg.tree_top_k)
    cache = commit_path(state.cache, new_kv, acc.path, active)
    count = acc.num_accepted + 1  # accepted drafts + the bonus token
    # Emitted this round: path tokens after the root, then the bonus token.
    path_tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(acc.path, 0), axis=1)  # [B, W]
    width = acc.path.shape[1]
    j = jnp.arange(width)[None, :]
    following = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
    new_tokens = jnp.where(j < acc.num_accepted[:, None], following,
                           jnp.where(j == acc.num_accepted[:, None], acc.bonus[:, None], -1))
    path_taps = jnp.take_along_axis(taps, jnp.maximum(acc.path, 0)[:, :, None], axis=1)
    root_h, root_logp, draft_k, draft_v, _ = _draft_extend(
        head, embed, path_taps, new_tokens, count, draft_k, draft_v, end)
    out = append_tokens(state.out, new_tokens, count, active, eos_token_ids)
    # The round's acceptance length is what it emitted: an EOS and tokens past max_new_tokens
    # are verified but not emitted, so not counted (new tokens / rounds, as everywhere).
    emitted = out.num_generated - state.out.num_generated
    # A row stops when the next tree would not fit in its target cache.
    out = out.stop_where(cache.end + tree_cfg.total_tokens + width > cache.max_len)
    keep = active[:, None]
    return dataclasses.replace(
        state, cache=cache, draft_k=draft_k, draft_v=draft_v,
        root=jnp.where(active, acc.bonus, state.root),
        root_logp=jnp.where(keep, root_logp, state.root_logp),
        root_h=jnp.where(keep, root_h, state.root_h),
        rounds=state.rounds + active.astype(jnp.int32),
        accept_hist=state.accept_hist.at[rows[:, 0], emitted].add(active.astype(jnp.int32)),
        step=step, out=out)


def _plain_step(target_params, state: EagleState, *, cfg: TargetConfig, tree_cfg: TreeConfig,
                sampling, eos_token_ids, tap_layers=()) -> EagleState:
    """One plain decode step (after a Fallback): feed the root at slot ``end``, sample the next
    token from the target, emit it. The draft's cache does not move: the step's draft entry
    (the root's tap, the new token) waits in ``stale_taps`` / ``stale_tokens`` for the next
    catch-up (only counted in ``stale`` where the fallback never resumes: no buffer)."""
    active = ~state.out.done
    step = state.step + 1
    window = state.stale_tokens.shape[1]
    token, cache, taps = decode_step(target_params, cfg, state.cache, state.root, active,
                                     jax.random.fold_in(state.key, step), sampling,
                                     tap_layers if window else ())
    emitted = append_tokens(state.out, token[:, None], jnp.ones_like(cache.end), active,
                            eos_token_ids)
    # The same stop rule as a round's, so a row ends where it would have under EAGLE.
    emitted = emitted.stop_where(cache.end + tree_cfg.total_tokens + tree_cfg.depth + 1
                                 > cache.max_len)
    stale_taps, stale_tokens = state.stale_taps, state.stale_tokens
    if window:  # a row's entry at its own count; inactive rows write nothing (index dropped)
        rows = jnp.arange(token.shape[0])
        at = jnp.where(active, state.stale, window)
        stale_taps = stale_taps.at[rows, at].set(taps[:, 0], mode="drop")
        stale_tokens = stale_tokens.at[rows, at].set(token, mode="drop")
    return dataclasses.replace(state, cache=cache, root=jnp.where(active, token, state.root),
                               out=emitted, step=step,
                               plain_steps=state.plain_steps + active.astype(jnp.int32),
                               stale=state.stale + active.astype(jnp.int32),
                               stale_taps=stale_taps, stale_tokens=stale_tokens)


def _catch_up(target_params, head: DraftHead, state: EagleState, fallback: Fallback,
              depth: int) -> EagleState:
    """The draft reads the ``stale`` entries the plain steps left (one forward over the
    buffer), so it can draft from the root again, and scores its top-1 on the tokens the target
    emitted after the last ``RESUME_SCORED`` of them (its output there); drafting resumes (a
    new probe: ``probe_*``) where :meth:`Fallback.resumes` says it pays."""
    count = state.stale
    b, w = state.stale_tokens.shape
    n = min(RESUME_SCORED, w - 1)
    root_h, root_logp, draft_k, draft_v, logits = _draft_extend(
        head, target_params["embed"], state.stale_taps, state.stale_tokens, count,
        state.draft_k, state.draft_v, state.cache.end - count, scored=n)
    # Scored entry e = count - 1 - n + i predicts entry e + 1's token.
    at = (count - 1 - n)[:, None] + jnp.arange(n)[None, :]  # [B, n]
    predicted = head.vocab.draft_to_target[jnp.argmax(logits, axis=-1)]
    following = jnp.take_along_axis(state.stale_tokens, jnp.clip(at + 1, 0, w - 1), axis=1)
    scored = at >= 0
    hits = jnp.sum(scored & (predicted == following), axis=1)
    seen = jnp.sum(scored, axis=1)
    moved = (count > 0)[:, None]
    resume = fallback.resumes(hits, seen, depth)
    return dataclasses.replace(
        state, draft_k=draft_k, draft_v=draft_v,
        root_h=jnp.where(moved, root_h, state.root_h),
        root_logp=jnp.where(moved, root_logp, state.root_logp),
        stale=jnp.zeros_like(count), plain=state.plain & ~resume,
        probe_step=jnp.where(resume, state.step, state.probe_step),
        probe_rounds=jnp.where(resume, state.rounds, state.probe_rounds),
        probe_hist=jnp.where(resume, state.accept_hist, state.probe_hist),
        resumes=state.resumes + (resume & ~state.out.done).astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class EagleDecoding:
    """EAGLE-3 decoding as a driver spec (:mod:`eagle3_jax.decoding.driver`); its ``params``
    are ``(target_params, head)``."""

    cfg: TargetConfig
    tree: TreeConfig
    max_new_tokens: int
    max_len: int
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: tuple[int, ...] = ()
    proposer: Callable = draft_proposer
    fallback: Fallback | None = None

    def prefill(self, params, prompt_tokens, prompt_lengths, key,
                prefix: driver.Prefix | None = None) -> EagleState:
        """The target's prefill and the draft's, after the first ``prefix.start`` prompt
        tokens of each row when an earlier call's caches (:meth:`reusable`) hold them."""
        target_params, head = params
        return _prefill(target_params, head, prompt_tokens, prompt_lengths, key, cfg=self.cfg,
                        tree_cfg=self.tree, sampling=self.sampling,
                        eos_token_ids=self.eos_token_ids, max_new_tokens=self.max_new_tokens,
                        max_len=self.max_len, resume_window=self._resume_window, prefix=prefix)

    @property
    def _resume_window(self) -> int:
        return self.fallback.resume_window if self.fallback is not None else 0

    def step(self, params, state: EagleState) -> EagleState:
        """One draft-verify-accept-commit round; with a fallback, then its check."""
        target_params, head = params
        state = _round(target_params, head, state, cfg=self.cfg, tree_cfg=self.tree,
                       sampling=self.sampling, eos_token_ids=self.eos_token_ids,
                       proposer=self.proposer)
        if self.fallback is None:
            return state
        gives_up = self.fallback.gives_up(state.step - state.probe_step,
                                          state.rounds - state.probe_rounds,
                                          state.accept_hist - state.probe_hist)
        return dataclasses.replace(state, plain=state.plain | gives_up)

    def plain_step(self, params, state: EagleState) -> EagleState:
        """One plain decode step (after the fallback gave up drafting)."""
        return _plain_step(params[0], state, cfg=self.cfg, tree_cfg=self.tree,
                           sampling=self.sampling, eos_token_ids=self.eos_token_ids,
                           tap_layers=params[1].cfg.tap_layers)

    def catch_up(self, params, state: EagleState) -> EagleState:
        """The draft reads the plain steps' entries; drafting may resume (:func:`_catch_up`)."""
        return _catch_up(params[0], params[1], state, self.fallback, self.tree.depth)

    @property
    def phases(self):
        """Rounds; with a fallback, rounds while it keeps drafting, then plain steps (the
        driver runs each phase as its own loop). With a fallback that may resume, the plain
        steps last until ``resume_window`` of them wait for the draft, then one catch-up, and
        the three phases repeat (``cycles``) until every row is done."""
        if self.fallback is None:
            return ((self.step, None),)
        if not self._resume_window:
            return ((self.step, lambda state: ~state.plain), (self.plain_step, None))
        full = lambda state: jnp.max(state.stale) >= self._resume_window  # noqa: E731
        return ((self.step, lambda state: ~state.plain),
                (self.plain_step, lambda state: state.plain & ~full(state)),
                (self.catch_up, lambda state: state.plain & full(state)))

    @property
    def cycles(self) -> bool:
        return len(self.phases) > 2

    def output(self, state: EagleState) -> EagleOutput:
        return EagleOutput(tokens=state.out.tokens, num_generated=state.out.num_generated,
                           hit_eos=state.out.hit_eos, rounds=state.rounds,
                           accept_hist=state.accept_hist, plain_steps=state.plain_steps,
                           resumes=state.resumes)

    def reusable(self, state: EagleState) -> EagleCaches:
        """Both caches, for a later call's :class:`eagle3_jax.decoding.driver.Prefix`. Plain
        steps after a fallback move the target's cache; the draft's lags by the ``stale``
        ones it has not read."""
        return EagleCaches(state.cache, state.draft_k, state.draft_v,
                           state.cache.end - state.stale)

    @staticmethod
    def reusable_slots(caches: EagleCaches) -> jax.Array:
        """[B] leading prompt tokens both caches can serve: the draft's entry s also holds
        token s + 1, so one more than its entries."""
        return jnp.minimum(caches.cache.end, caches.draft_end + 1)

    @staticmethod
    def reuse_start(common: int, prompt_len: int) -> int:
        """Prompt tokens taken from a prefix that holds the first ``common`` of them: the draft
        entry before the new ones pairs f_{s-1} with x_s, so one fewer than plain decoding
        (the tap f_{s-1} is not kept, so entry s - 1 is redone), and never the last token."""
        return PlainDecoding.reuse_start(common - 1, prompt_len)


def eagle_cache_size(cfg: TargetConfig, prompt_width: int, max_new_tokens: int,
                     tree_cfg: TreeConfig) -> int:
    """Target KV slots: prompt + new tokens + one tree + one round of slack, bucketed and capped
    at the model context (as plain decoding does: a row that fills the context stops there).

    Raises GenerationError when not even the prompt and one tree fit the context.
    """
    tree_room = tree_cfg.total_tokens + tree_cfg.depth + 2
    context = cfg.max_position_embeddings
    if prompt_width + tree_room > context:
        raise GenerationError(
            f"prompt of {prompt_width} tokens + one draft tree ({tree_room} slots) exceeds the "
            f"model context of {context} tokens; shorten the prompt or use a smaller tree")
    return min(bucket(prompt_width + max_new_tokens + tree_room), context)


def eagle_decoding(cfg: TargetConfig, head: DraftHead, prompt_tokens, prompt_lengths, *,
                   max_new_tokens: int, tree: TreeConfig = TreeConfig(),
                   sampling: SamplingParams = SamplingParams(), eos_token_ids: Sequence[int] = (),
                   max_len: int | None = None, proposer=draft_proposer,
                   fallback: Fallback | None = None):
    """(EagleDecoding, tokens, lengths) after the driver's one argument check (the same as
    plain decoding's) and the head's fit to the target."""
    head.cfg.check_fits(cfg)
    tokens, lengths, max_len = check_prompts(
        cfg, prompt_tokens, prompt_lengths, max_new_tokens, max_len,
        lambda width: eagle_cache_size(cfg, width, max_new_tokens, tree))
    spec = EagleDecoding(cfg, tree, int(max_new_tokens), max_len, sampling,
                         eos_tuple(eos_token_ids), proposer, fallback)
    return spec, tokens, lengths


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
    fallback: Fallback | None = None,
) -> EagleOutput:
    """Speculative generation with an EAGLE-3 head, one jitted call (see module docstring).

    Args mirror :func:`eagle3_jax.decoding.generate`; ``tree`` sets the draft tree shape,
    ``fallback`` when to give up drafting (None: never). Output tokens equal plain decoding's
    for greedy sampling, and follow the target's exact distribution otherwise.
    """
    head = head.serving()
    spec, tokens, lengths = eagle_decoding(
        cfg, head, prompt_tokens, prompt_lengths, max_new_tokens=max_new_tokens, tree=tree,
        sampling=sampling, eos_token_ids=eos_token_ids, max_len=max_len, proposer=proposer,
        fallback=fallback)
    key = jax.random.PRNGKey(0) if key is None else key
    return driver.run(spec, (target_params, head), tokens, lengths, key)


def compile_generate_eagle(target_params, cfg: TargetConfig, head: DraftHead, prompt_tokens,
                           prompt_lengths, *, max_new_tokens: int, tree: TreeConfig = TreeConfig(),
                           sampling: SamplingParams = SamplingParams(),
                           eos_token_ids: Sequence[int] = (), max_len: int | None = None,
                           fallback: Fallback | None = None) -> Callable[..., EagleOutput]:
    """Compile :func:`generate_eagle` ahead of time for these shapes (compilation timed apart).

    Returns ``run(target_params, head, prompt_tokens, prompt_lengths, key) -> EagleOutput``.
    """
    head = head.serving()
    spec, tokens, lengths = eagle_decoding(
        cfg, head, prompt_tokens, prompt_lengths, max_new_tokens=max_new_tokens, tree=tree,
        sampling=sampling, eos_token_ids=eos_token_ids, max_len=max_len, fallback=fallback)
    compiled = driver.compile_run(spec, (target_params, head), tokens, lengths)

    def run(target_params, head, prompt_tokens, prompt_lengths, key) -> EagleOutput:
        _, tokens, lengths = eagle_decoding(cfg, head, prompt_tokens, prompt_lengths,
                                            max_new_tokens=max_new_tokens, tree=tree,
                                            max_len=spec.max_len)
        return compiled((target_params, head.serving()), tokens, lengths, key)

    return run


def generate_eagle_stream(target_params, cfg: TargetConfig, head: DraftHead, prompt_tokens,
                          prompt_lengths, *, max_new_tokens: int, tree: TreeConfig = TreeConfig(),
                          sampling: SamplingParams = SamplingParams(),
                          key: jax.Array | None = None, eos_token_ids: Sequence[int] = (),
                          max_len: int | None = None, fallback: Fallback | None = None
                          ) -> Iterator[list[np.ndarray]]:
    """Like :func:`generate_eagle`, but yields after the prefill and after every round.

    Each item holds, per row, the int32 tokens emitted in that step (empty when none). The same
    prefill and round run (jitted apart), with the same keys, so the tokens equal
    :func:`generate_eagle`'s for the same ``key``.
    """
    head = head.serving()
    spec, tokens, lengths = eagle_decoding(
        cfg, head, prompt_tokens, prompt_lengths, max_new_tokens=max_new_tokens, tree=tree,
        sampling=sampling, eos_token_ids=eos_token_ids, max_len=max_len, fallback=fallback)
    key = jax.random.PRNGKey(0) if key is None else key
    yield from driver.stream(spec, (target_params, head), tokens, lengths, key)
