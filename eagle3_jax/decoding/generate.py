"""Plain (non-speculative) autoregressive generation: one prefill, then one decode step per token.

:class:`PlainDecoding` is the spec the generation driver (:mod:`eagle3_jax.decoding.driver`)
runs: ``prefill`` is a forward over the padded prompts that samples each row's first token,
``step`` feeds each row's last token and samples the next. ``generate`` runs them in one jitted
``lax.while_loop``; ``generate_stream`` runs the *same* prefill and step jitted apart and yields
each step's tokens to the host. Both draw the same random keys, so for a given ``key`` they
produce the same tokens.

Decode state (all on device, fixed shapes)::

    cache          KVCache, S = max_len slots; end[b] = committed tokens of row b
    last_token     [B]    sampled but not yet in the cache (the next step's input)
    step           []     sampling steps so far (prefill's is step 0)
    out            Emitted: tokens [B, N] (-1 where nothing was generated; EOS is *not*
                   written), num_generated [B], done [B], hit_eos [B]

A row is done on EOS, N tokens, a full cache, or as a padding row (length 0). A row that is done
still runs through the forward (the batch shape is static); its cache end no longer moves, so
what it writes lands in a slot nobody reads, or is dropped past the end.
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
from eagle3_jax.decoding.driver import Emitted, append_tokens, check_prompts, eos_tuple
from eagle3_jax.decoding.sampling import SamplingParams, sample
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import Params
from eagle3_jax.model.target import KVCache, causal_mask, forward, prefill


@struct.dataclass
class DecodeState:
    cache: KVCache
    last_token: jax.Array  # [B] int32
    step: jax.Array  # [] int32
    out: Emitted
    key: jax.Array


@struct.dataclass
class GenerateOutput:
    """Result of :func:`generate`.

    Attributes:
      tokens: [B, max_new_tokens] int32 generated ids, -1 after the row finished. The EOS token
        that ended a row is not included (``hit_eos`` says it was sampled).
      num_generated: [B] int32 number of valid entries in ``tokens``.
      hit_eos: [B] bool, the row ended by sampling an end-of-sequence id.
      steps: [] int32 decode steps run after the prefill (while-loop trips).
    """

    tokens: jax.Array
    num_generated: jax.Array
    hit_eos: jax.Array
    steps: jax.Array


def decode_step(params: Params, cfg: TargetConfig, cache: KVCache, token: jax.Array,
                active: jax.Array, key: jax.Array, sampling: SamplingParams,
                tap_layers: Sequence[int] = ()) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """One decode step: feed ``token`` [B] at slot ``cache.end``, sample the next token [B];
    the cache's ``end`` moves on for ``active`` [B] rows only. Plain decoding's step, and
    EAGLE's once it gives up drafting (:class:`eagle3_jax.decoding.eagle.Fallback`), which
    also reads the fed token's ``taps`` [B, 1, len(tap_layers) * D] (None without
    ``tap_layers``) to catch its draft up later."""
    out = forward(params, cfg, token[:, None], cache.end[:, None],
                  causal_mask(cache.end, 1, cache.max_len), cache, tap_layers=tap_layers)
    next_token = sample(key, out.logits[:, 0], sampling)
    return (next_token, dataclasses.replace(out.cache, end=cache.end + active.astype(jnp.int32)),
            out.taps)


@dataclasses.dataclass(frozen=True)
class PlainDecoding:
    """Plain decoding of ``cfg`` as a driver spec (see :mod:`eagle3_jax.decoding.driver`)."""

    cfg: TargetConfig
    max_new_tokens: int
    max_len: int
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: tuple[int, ...] = ()

    def _emit(self, state: DecodeState, token: jax.Array, active: jax.Array) -> DecodeState:
        out = append_tokens(state.out, token[:, None], jnp.ones_like(state.cache.end), active,
                            self.eos_token_ids)
        # A row whose cache is full cannot feed its last token back: it stops after emitting it.
        out = out.stop_where(state.cache.end >= state.cache.max_len)
        return dataclasses.replace(state, last_token=token, out=out)

    def prefill(self, params: Params, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
                key: jax.Array, prefix: driver.Prefix | None = None) -> DecodeState:
        """Run the (right-padded) prompt tokens, after the first ``prefix.start`` of each row
        when an earlier call's cache (``prefix.caches``, :meth:`reusable`) holds them, and
        sample each row's first token."""
        b = prompt_tokens.shape[0]
        cache = (None if prefix is None
                 else prefix.caches.resized(self.max_len).replace(end=prefix.start))
        out = prefill(params, self.cfg, prompt_tokens, prompt_lengths, self.max_len,
                      prefix=cache)
        token = sample(jax.random.fold_in(key, 0), out.logits[:, 0], self.sampling)
        state = DecodeState(cache=out.cache, last_token=jnp.zeros((b,), jnp.int32),
                            step=jnp.zeros((), jnp.int32),
                            out=Emitted.empty(b, self.max_new_tokens), key=key)
        return self._emit(state, token, prompt_lengths > 0)

    def step(self, params: Params, state: DecodeState) -> DecodeState:
        """Feed each row's last token at slot ``end``, advance live rows by one, sample next."""
        active = ~state.out.done
        step = state.step + 1
        token, cache, _ = decode_step(params, self.cfg, state.cache, state.last_token, active,
                                      jax.random.fold_in(state.key, step), self.sampling)
        return self._emit(dataclasses.replace(state, cache=cache, step=step), token, active)

    def output(self, state: DecodeState) -> GenerateOutput:
        return GenerateOutput(tokens=state.out.tokens, num_generated=state.out.num_generated,
                              hit_eos=state.out.hit_eos, steps=state.step)

    def reusable(self, state: DecodeState) -> KVCache:
        """What a later call may start from (:class:`eagle3_jax.decoding.driver.Prefix`): the
        cache, whose first ``end`` [B] slots hold the prompt and the tokens fed since."""
        return state.cache

    @staticmethod
    def reusable_slots(caches: KVCache) -> jax.Array:
        """[B] leading slots of :meth:`reusable`'s caches that hold known tokens."""
        return caches.end

    @staticmethod
    def reuse_start(common: int, prompt_len: int) -> int:
        """Prompt tokens taken from a prefix that holds the first ``common`` of them: all but
        the last (which must run for the first token's logits)."""
        return max(min(common, prompt_len - 1), 0)


def cache_size(cfg: TargetConfig, prompt_width: int, max_new_tokens: int) -> int:
    """Default KV-cache slots: bucket(P + max_new_tokens), capped at the model context."""
    return bucket(prompt_width + max_new_tokens, 16, cfg.max_position_embeddings)


def plain_decoding(cfg: TargetConfig, prompt_tokens, prompt_lengths, *, max_new_tokens: int,
                   sampling: SamplingParams = SamplingParams(), eos_token_ids: Sequence[int] = (),
                   max_len: int | None = None):
    """(PlainDecoding, tokens, lengths) after the driver's one argument check."""
    tokens, lengths, max_len = check_prompts(
        cfg, prompt_tokens, prompt_lengths, max_new_tokens, max_len,
        lambda width: cache_size(cfg, width, max_new_tokens))
    spec = PlainDecoding(cfg, int(max_new_tokens), max_len, sampling, eos_tuple(eos_token_ids))
    return spec, tokens, lengths


def generate(
    params: Params,
    cfg: TargetConfig,
    prompt_tokens: jax.Array | np.ndarray,
    prompt_lengths: jax.Array | np.ndarray,
    *,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    key: jax.Array | None = None,
    eos_token_ids: Sequence[int] = (),
    max_len: int | None = None,
) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` per row, all on device in one jitted call.

    Args:
      params, cfg: the target model.
      prompt_tokens: [B, P] int32, right-padded (see :func:`eagle3_jax.decoding.pad_prompts`).
      prompt_lengths: [B] true lengths; a 0-length row is batch padding and generates nothing.
      max_new_tokens: N, the most tokens generated per row (EOS not counted).
      sampling: temperature / top-k / top-p; the default is greedy.
      key: PRNG key (unused when greedy; defaults to ``PRNGKey(0)``).
      eos_token_ids: ids that end a row; the EOS itself is not included in the output.
      max_len: KV-cache slots, default ``bucket(P + N)`` capped at the model context. A row also
        stops when its cache is full (then it has fewer than N tokens and ``hit_eos`` False).
    Returns:
      :class:`GenerateOutput` with tokens [B, N] (-1 padded) and num_generated [B].
    Raises:
      GenerationError (a ValueError): a prompt longer than the model context or the cache.
    """
    spec, tokens, lengths = plain_decoding(cfg, prompt_tokens, prompt_lengths,
                                           max_new_tokens=max_new_tokens, sampling=sampling,
                                           eos_token_ids=eos_token_ids, max_len=max_len)
    key = jax.random.PRNGKey(0) if key is None else key
    return driver.run(spec, params, tokens, lengths, key)


def compile_generate(
    params: Params,
    cfg: TargetConfig,
    prompt_tokens: jax.Array | np.ndarray,
    prompt_lengths: jax.Array | np.ndarray,
    *,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    eos_token_ids: Sequence[int] = (),
    max_len: int | None = None,
) -> Callable[..., GenerateOutput]:
    """Compile :func:`generate` ahead of time for these shapes, so compilation can be timed apart.

    Returns ``run(params, prompt_tokens, prompt_lengths, key) -> GenerateOutput`` for arrays of
    the same shapes (any contents), with the same settings as given here.
    """
    spec, tokens, lengths = plain_decoding(cfg, prompt_tokens, prompt_lengths,
                                           max_new_tokens=max_new_tokens, sampling=sampling,
                                           eos_token_ids=eos_token_ids, max_len=max_len)
    compiled = driver.compile_run(spec, params, tokens, lengths)

    def run(params, prompt_tokens, prompt_lengths, key) -> GenerateOutput:
        _, tokens, lengths = plain_decoding(cfg, prompt_tokens, prompt_lengths,
                                            max_new_tokens=max_new_tokens, max_len=spec.max_len)
        return compiled(params, tokens, lengths, key)

    return run


def generate_stream(
    params: Params,
    cfg: TargetConfig,
    prompt_tokens: jax.Array | np.ndarray,
    prompt_lengths: jax.Array | np.ndarray,
    *,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    key: jax.Array | None = None,
    eos_token_ids: Sequence[int] = (),
    max_len: int | None = None,
) -> Iterator[np.ndarray]:
    """Like :func:`generate`, but yields after the prefill and after every decode step.

    Each item is a host array [B] int32: the token each row produced in that step, or -1 where
    it produced none (finished, or sampled EOS). Same arguments and same tokens as
    :func:`generate` for the same ``key``; costs one small device-to-host copy per step.
    """
    spec, tokens, lengths = plain_decoding(cfg, prompt_tokens, prompt_lengths,
                                           max_new_tokens=max_new_tokens, sampling=sampling,
                                           eos_token_ids=eos_token_ids, max_len=max_len)
    key = jax.random.PRNGKey(0) if key is None else key
    for rows in driver.stream(spec, params, tokens, lengths, key):
        yield np.array([row[0] if len(row) else -1 for row in rows], np.int32)
