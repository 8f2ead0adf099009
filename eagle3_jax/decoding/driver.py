"""One generation driver for plain and EAGLE decoding: a prefill and a step, run three ways.

A *decoding* is a frozen, hashable spec (a static jit argument) with three pure methods::

    prefill(params, prompt_tokens [B, P], prompt_lengths [B], key) -> state
    step(params, state) -> state        # one decode step / one EAGLE round, every live row
    output(state) -> result             # what the caller gets back

where ``state.out`` is an :class:`Emitted` (the generated tokens so far and the stop flags).
Instead of ``step`` a decoding may have ``phases``: ``(step, keeps)`` pairs run in order, each
while a row is live and ``keeps(state)`` ([] bool; None: always) holds (EAGLE's rounds until a
fallback gives up drafting, then plain steps). A decoding whose ``cycles`` is true runs its
phases again, in order, until every row is done (EAGLE's plain steps, the draft's catch-up,
and rounds again where drafting resumes); its phases' ``keeps`` must then be exclusive and cover
every state, so each pass moves on. Each phase is its own loop: a ``lax.cond``
choosing the step inside one loop would copy every KV-cache buffer into and out of the chosen
branch on every step (120 copies, about 3 ms a step for SmolLM2 on a 2-core CPU).
The driver runs it

* :func:`run`: prefill, then one ``lax.while_loop`` per phase until every row is done, all in
  one jitted call (no host round trip);
* :func:`compile_run`: the same, compiled ahead of time for fixed shapes (compilation timed
  apart);
* :func:`stream`: the same prefill and step, jitted apart, yielding each step's new tokens to
  the host. Same keys, so the same tokens as :func:`run`.

A decoding may also start from what an earlier call left (a chat's next turn): its
``reusable(state)`` is the KV caches, and ``prefill(..., prefix=Prefix(caches, start))`` runs
only the prompt tokens after each row's ``start``. ``reusable_slots(caches)`` and
``reuse_start(common, prompt_len)`` (host side) say how many tokens the caches hold and how many
of a prompt sharing ``common`` of them may be skipped (:mod:`eagle3_jax.decoding.decoders`).

:func:`append_tokens` is the one place tokens enter the output: per row, the first ``count`` of
a step's tokens, cut before an end-of-sequence id and at ``max_new_tokens``. So the tokens a
row emits (and the acceptance length, new tokens / rounds) never include an EOS or anything past
the limit. :func:`check_prompts` is the one argument check of every decoder.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from eagle3_jax.errors import Eagle3Error
from eagle3_jax.model.config import TargetConfig


class GenerationError(Eagle3Error, ValueError):
    """Prompts or limits a decoder cannot run (too long, empty, malformed); says what fits."""


@struct.dataclass
class Emitted:
    """Generated tokens and stop flags, fixed shapes.

    tokens [B, N] int32 (-1 where nothing was emitted; EOS is never written), num_generated [B],
    done [B] (EOS, N tokens, no room for another step, or a padding row), hit_eos [B].
    """

    tokens: jax.Array
    num_generated: jax.Array
    done: jax.Array
    hit_eos: jax.Array

    @classmethod
    def empty(cls, batch: int, max_new_tokens: int) -> "Emitted":
        return cls(tokens=jnp.full((batch, max_new_tokens), -1, jnp.int32),
                   num_generated=jnp.zeros((batch,), jnp.int32),
                   done=jnp.zeros((batch,), bool), hit_eos=jnp.zeros((batch,), bool))

    def stop_where(self, full: jax.Array) -> "Emitted":
        """Rows with no room for another step ([B] bool) are done."""
        return self.replace(done=self.done | full)


def append_tokens(out: Emitted, new_tokens: jax.Array, count: jax.Array, active: jax.Array,
                  eos_token_ids: tuple[int, ...]) -> Emitted:
    """Append the first ``count`` [B] of ``new_tokens`` [B, W] for ``active`` [B] rows.

    A row stops at its first EOS among them (not written, ``hit_eos`` set) or once it holds
    N = ``out.tokens.shape[1]`` tokens; inactive rows emit nothing and are done.
    """
    b, w = new_tokens.shape
    max_new_tokens = out.tokens.shape[1]
    j = jnp.arange(w)[None, :]
    is_eos = jnp.zeros(new_tokens.shape, bool)
    for eos in eos_token_ids:
        is_eos = is_eos | (new_tokens == eos)
    first_eos = jnp.min(jnp.where(is_eos & (j < count[:, None]), j, w), axis=1)
    room = max_new_tokens - out.num_generated
    n_emit = jnp.where(active, jnp.minimum(jnp.minimum(count, first_eos), room), 0)
    dst = jnp.where(j < n_emit[:, None], out.num_generated[:, None] + j, max_new_tokens)
    tokens = out.tokens.at[jnp.arange(b)[:, None], dst].set(new_tokens, mode="drop")
    num_generated = out.num_generated + n_emit
    hit_eos = out.hit_eos | (active & (first_eos < jnp.minimum(count, room)))
    done = out.done | ~active | hit_eos | (num_generated >= max_new_tokens)
    return Emitted(tokens=tokens, num_generated=num_generated, done=done, hit_eos=hit_eos)


def check_prompts(cfg: TargetConfig, prompt_tokens, prompt_lengths, max_new_tokens: int,
                  max_len: int | None, default_max_len) -> tuple[jax.Array, jax.Array, int]:
    """Host-side validation of every decoder's inputs.

    ``default_max_len(prompt_width) -> int`` gives the KV-cache slots when ``max_len`` is None
    (it may raise GenerationError when not even the prompt fits). Returns (tokens [B, P] int32,
    lengths [B] int32, max_len) ready for the jitted code.
    """
    tokens = np.asarray(prompt_tokens)
    lengths = np.asarray(prompt_lengths)
    if tokens.ndim != 2 or lengths.shape != tokens.shape[:1]:
        raise GenerationError(f"prompt_tokens must be [B, P] and prompt_lengths [B], got "
                              f"{tokens.shape} and {lengths.shape}")
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    width = tokens.shape[1]
    longest = int(lengths.max())
    if lengths.min() < 0 or longest > width:
        raise GenerationError(f"prompt_lengths must be in [0, {width}] (the padded width), "
                              f"got {lengths.tolist()}")
    context = cfg.max_position_embeddings
    if longest > context:
        raise GenerationError(f"prompt of {longest} tokens is longer than the model context of "
                              f"{context} tokens; shorten the prompt")
    if max_len is None:
        max_len = default_max_len(width)
    if max_len > context:
        raise GenerationError(f"max_len {max_len} exceeds the model context of {context} "
                              f"tokens; use max_len <= {context}")
    if longest > max_len:
        raise GenerationError(f"prompt of {longest} tokens does not fit a KV cache of max_len "
                              f"{max_len} slots; raise max_len (at most the context, {context})")
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32), int(max_len)


def phases(decoding) -> tuple[tuple[Callable, Callable | None], ...]:
    """The decoding's ``(step, keeps)`` phases (module docstring); one, ``(step, None)``, for a
    decoding without ``phases``."""
    return getattr(decoding, "phases", None) or ((decoding.step, None),)


@struct.dataclass
class Prefix:
    """What an earlier call left for the next one to reuse: ``caches``, a decoding's
    ``reusable(state)`` (its KV caches, any number of slots), of which each row's first
    ``start`` [B] tokens are the new prompt's first tokens; the prefill runs only the rest."""

    caches: Any
    start: jax.Array


def _loop(decoding, params, prompt_tokens, prompt_lengths, key, prefix=None, keep=False):
    if prefix is None:
        state = decoding.prefill(params, prompt_tokens, prompt_lengths, key)
    else:
        state = decoding.prefill(params, prompt_tokens, prompt_lengths, key, prefix=prefix)
    def run_phases(state):
        for step, keeps in phases(decoding):
            def live(s, keeps=keeps):
                return ~jnp.all(s.out.done) & (True if keeps is None else keeps(s))
            state = jax.lax.while_loop(live, functools.partial(step, params), state)
        return state

    if getattr(decoding, "cycles", False):
        state = jax.lax.while_loop(lambda s: ~jnp.all(s.out.done), run_phases, state)
    else:
        state = run_phases(state)
    if keep:
        return decoding.output(state), decoding.reusable(state)
    return decoding.output(state)


_loop_jit = jax.jit(_loop, static_argnames=("decoding", "keep"))
_prefill_jit = jax.jit(lambda decoding, *args: decoding.prefill(*args),
                       static_argnames=("decoding",))
_step_jit = jax.jit(lambda decoding, phase, params, state:
                    phases(decoding)[phase][0](params, state),
                    static_argnames=("decoding", "phase"), donate_argnames=("state",))
_keeps_jit = jax.jit(lambda decoding, phase, state: phases(decoding)[phase][1](state),
                     static_argnames=("decoding", "phase"))


def start(decoding, params: Any, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
          key: jax.Array, prefix: Prefix | None = None):
    """The state after the prefill (jitted apart, as :func:`stream` runs it), from ``prefix``
    when given."""
    args = (params, prompt_tokens, prompt_lengths, key) + (() if prefix is None else (prefix,))
    return _prefill_jit(decoding, *args)


def advance(decoding, params: Any, state):
    """One step / round of every row (jitted apart; ``state`` is donated), of the first phase
    whose ``keeps`` holds (read on the host where there are several)."""
    steps = phases(decoding)
    phase = next((i for i, (_, keeps) in enumerate(steps[:-1])
                  if keeps is None or bool(_keeps_jit(decoding, i, state))), len(steps) - 1)
    return _step_jit(decoding, phase, params, state)


def run(decoding, params: Any, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
        key: jax.Array):
    """Generate in one jitted call; returns ``decoding.output(final state)``."""
    return _loop_jit(decoding, params, prompt_tokens, prompt_lengths, key)


def compile_run(decoding, params: Any, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
                prefix: Prefix | None = None, keep: bool = False):
    """:func:`run` compiled ahead of time for these shapes: ``run(params, tokens, lengths,
    key)`` for arrays of the same shapes (any contents).

    With a ``prefix`` (a :class:`Prefix` of these shapes), ``run(params, tokens, lengths, key,
    prefix)`` starts from it. ``keep``: ``run`` returns ``(output, reusable)``, where
    ``reusable`` (``decoding.reusable(final state)``) can make the next call's :class:`Prefix`.
    """
    args = (params, prompt_tokens, prompt_lengths, jax.random.PRNGKey(0))
    args += () if prefix is None else (prefix,)
    return _loop_jit.lower(decoding, *args, keep=keep).compile()


def stream(decoding, params: Any, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
           key: jax.Array, on_step: Callable[[Any], None] | None = None,
           prefix: Prefix | None = None) -> Iterator[list[np.ndarray]]:
    """Yield after the prefill and after every step: per row, the int32 tokens emitted in that
    step (empty when none). Costs one small device-to-host copy per step. ``on_step(state)``,
    when given, sees each state (the prefill's, then every step's) before its tokens are
    yielded; a state is donated to the next step, so only the last one seen stays readable.
    ``prefix``: start from an earlier call's caches, as :func:`compile_run`."""
    state = start(decoding, params, prompt_tokens, prompt_lengths, key, prefix)
    produced = np.zeros(prompt_tokens.shape[0], np.int64)
    while True:
        if on_step is not None:
            on_step(state)
        out, count, done = jax.device_get((state.out.tokens, state.out.num_generated,
                                           state.out.done))
        yield [out[i, produced[i]:count[i]] for i in range(out.shape[0])]
        produced = count.astype(np.int64)
        if done.all():
            return
        state = advance(decoding, params, state)


def eos_tuple(eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(e) for e in eos_token_ids)
