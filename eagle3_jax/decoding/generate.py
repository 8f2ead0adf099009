"""Plain (non-speculative) autoregressive generation: one prefill, then one decode step per token.

``generate`` is a single jitted function: a prefill forward over the padded prompts, then one
``lax.while_loop`` over :func:`_decode_step` until every row is done. ``generate_stream`` runs
the *same* prefill and step functions, jitted separately, and yields each step's tokens to the
host (for printing as they are made). Both draw the same random keys, so for a given ``key``
they produce the same tokens.

Decode state (all on device, fixed shapes)::

    cache          KVCache, S = max_len slots; end[b] = committed tokens of row b
    last_token     [B]    sampled but not yet in the cache (the next step's input)
    step           []     sampling steps so far (prefill's is step 0)
    num_generated  [B]    tokens written to ``tokens``
    tokens         [B, N] generated ids, -1 where nothing was generated; EOS is *not* written
    done           [B]    row stopped: EOS, N tokens, cache full, or a padding row (length 0)
    hit_eos        [B]    row stopped because it sampled an end-of-sequence id

A row that is done still runs through the forward (the batch shape is static); its cache end no
longer moves, so what it writes lands in a slot nobody reads, or is dropped past the end.
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
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import Params
from eagle3_jax.model.target import KVCache, causal_mask, forward, prefill


@struct.dataclass
class DecodeState:
    cache: KVCache
    last_token: jax.Array  # [B] int32
    step: jax.Array  # [] int32
    num_generated: jax.Array  # [B] int32
    tokens: jax.Array  # [B, N] int32
    done: jax.Array  # [B] bool
    hit_eos: jax.Array  # [B] bool
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


def _record(state: DecodeState, token: jax.Array, active: jax.Array,
            eos_token_ids: tuple[int, ...]) -> DecodeState:
    """Store the token [B] sampled by each ``active`` row and update the stop flags."""
    max_new_tokens = state.tokens.shape[1]
    is_eos = jnp.zeros_like(active)
    for eos in eos_token_ids:
        is_eos = is_eos | (token == eos)
    is_eos = is_eos & active
    write = active & ~is_eos
    slot = jnp.arange(max_new_tokens)[None, :] == state.num_generated[:, None]  # [B, N]
    tokens = jnp.where(slot & write[:, None], token[:, None], state.tokens)
    num_generated = state.num_generated + write.astype(jnp.int32)
    # A row whose cache is full cannot feed its last token back: it stops after emitting it.
    cache_full = state.cache.end >= state.cache.max_len
    done = ~active | is_eos | (num_generated >= max_new_tokens) | cache_full
    return dataclasses.replace(
        state,
        last_token=jnp.where(write, token, state.last_token),
        num_generated=num_generated,
        tokens=tokens,
        done=done,
        hit_eos=state.hit_eos | is_eos,
    )


def _prefill(params: Params, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
             key: jax.Array, *, cfg: TargetConfig, max_new_tokens: int,
             sampling: SamplingParams, eos_token_ids: tuple[int, ...],
             max_len: int) -> DecodeState:
    """Run all P (right-padded) prompt tokens at once and sample each row's first token."""
    b = prompt_tokens.shape[0]
    out = prefill(params, cfg, prompt_tokens, prompt_lengths, max_len)
    token = sample(jax.random.fold_in(key, 0), out.logits[:, 0], sampling)
    state = DecodeState(
        cache=out.cache,
        last_token=jnp.zeros((b,), jnp.int32),
        step=jnp.zeros((), jnp.int32),
        num_generated=jnp.zeros((b,), jnp.int32),
        tokens=jnp.full((b, max_new_tokens), -1, jnp.int32),
        done=jnp.zeros((b,), bool),
        hit_eos=jnp.zeros((b,), bool),
        key=key,
    )
    return _record(state, token, prompt_lengths > 0, eos_token_ids)


def _decode_step(params: Params, state: DecodeState, *, cfg: TargetConfig,
                 sampling: SamplingParams, eos_token_ids: tuple[int, ...]) -> DecodeState:
    """Feed each row's last token at slot ``end``, advance live rows by one, sample the next."""
    cache = state.cache
    active = ~state.done
    out = forward(params, cfg, state.last_token[:, None], cache.end[:, None],
                  causal_mask(cache.end, 1, cache.max_len), cache)
    step = state.step + 1
    token = sample(jax.random.fold_in(state.key, step), out.logits[:, 0], sampling)
    cache = dataclasses.replace(out.cache, end=cache.end + active.astype(jnp.int32))
    return _record(dataclasses.replace(state, cache=cache, step=step), token, active,
                   eos_token_ids)


_STATIC = ("cfg", "max_new_tokens", "sampling", "eos_token_ids", "max_len")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _generate_jit(params, prompt_tokens, prompt_lengths, key, *, cfg, max_new_tokens,
                  sampling, eos_token_ids, max_len) -> GenerateOutput:
    state = _prefill(params, prompt_tokens, prompt_lengths, key, cfg=cfg,
                     max_new_tokens=max_new_tokens, sampling=sampling,
                     eos_token_ids=eos_token_ids, max_len=max_len)
    body = functools.partial(_decode_step, params, cfg=cfg, sampling=sampling,
                             eos_token_ids=eos_token_ids)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    return GenerateOutput(tokens=state.tokens, num_generated=state.num_generated,
                          hit_eos=state.hit_eos, steps=state.step)


_prefill_jit = jax.jit(_prefill, static_argnames=_STATIC)
_decode_step_jit = jax.jit(_decode_step, static_argnames=("cfg", "sampling", "eos_token_ids"),
                           donate_argnames=("state",))


def cache_size(cfg: TargetConfig, prompt_width: int, max_new_tokens: int) -> int:
    """Default KV-cache slots: bucket(P + max_new_tokens), capped at the model context."""
    return bucket(prompt_width + max_new_tokens, 16, cfg.max_position_embeddings)


def _check_args(cfg, prompt_tokens, prompt_lengths, max_new_tokens, max_len):
    """Host-side validation; returns (tokens, lengths, max_len) ready for the jitted code."""
    tokens = np.asarray(prompt_tokens)
    lengths = np.asarray(prompt_lengths)
    if tokens.ndim != 2 or lengths.shape != tokens.shape[:1]:
        raise ValueError(f"prompt_tokens must be [B, P] and prompt_lengths [B], got "
                         f"{tokens.shape} and {lengths.shape}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    width = tokens.shape[1]
    longest = int(lengths.max())
    if lengths.min() < 0 or longest > width:
        raise ValueError(f"prompt_lengths must be in [0, {width}] (the padded width), "
                         f"got {lengths.tolist()}")
    context = cfg.max_position_embeddings
    if longest > context:
        raise ValueError(f"prompt of {longest} tokens is longer than the model context of "
                         f"{context} tokens; shorten the prompt")
    if max_len is None:
        max_len = cache_size(cfg, width, max_new_tokens)
    if max_len > context:
        raise ValueError(f"max_len {max_len} exceeds the model context of {context} tokens; "
                         f"use max_len <= {context}")
    if longest > max_len:
        raise ValueError(f"prompt of {longest} tokens does not fit a KV cache of max_len "
                         f"{max_len} slots; raise max_len (at most the context, {context})")
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32), int(max_len)


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
      ValueError: a prompt longer than the model context or the cache.
    """
    tokens, lengths, max_len = _check_args(cfg, prompt_tokens, prompt_lengths, max_new_tokens,
                                           max_len)
    key = jax.random.PRNGKey(0) if key is None else key
    return _generate_jit(params, tokens, lengths, key, cfg=cfg, max_new_tokens=max_new_tokens,
                         sampling=sampling, eos_token_ids=tuple(int(e) for e in eos_token_ids),
                         max_len=max_len)


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
    tokens, lengths, max_len = _check_args(cfg, prompt_tokens, prompt_lengths, max_new_tokens,
                                           max_len)
    eos = tuple(int(e) for e in eos_token_ids)
    compiled = _generate_jit.lower(
        params, tokens, lengths, jax.random.PRNGKey(0), cfg=cfg, max_new_tokens=max_new_tokens,
        sampling=sampling, eos_token_ids=eos, max_len=max_len).compile()

    def run(params, prompt_tokens, prompt_lengths, key) -> GenerateOutput:
        tokens, lengths, _ = _check_args(cfg, prompt_tokens, prompt_lengths, max_new_tokens,
                                         max_len)
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
    tokens, lengths, max_len = _check_args(cfg, prompt_tokens, prompt_lengths, max_new_tokens,
                                           max_len)
    key = jax.random.PRNGKey(0) if key is None else key
    eos = tuple(int(e) for e in eos_token_ids)
    state = _prefill_jit(params, tokens, lengths, key, cfg=cfg, max_new_tokens=max_new_tokens,
                         sampling=sampling, eos_token_ids=eos, max_len=max_len)
    produced = np.zeros(tokens.shape[0], np.int32)
    while True:
        last, count, done = jax.device_get((state.last_token, state.num_generated, state.done))
        yield np.where(count > produced, last, -1).astype(np.int32)
        produced = count
        if done.all():
            return
        state = _decode_step_jit(params, state, cfg=cfg, sampling=sampling, eos_token_ids=eos)
