"""Plain decoding of a stream of prompts over a fixed number of slots, refilling finished rows.

:func:`generate` runs a batch until its *longest* answer ends: rows that finished early idle.
For bulk generation (``data regenerate``: thousands of answers of very different lengths) that
wastes most of the batch. :class:`ContinuousDecoder` keeps ``slots`` rows busy instead:

    loop:  refill every free slot with the next prompt (a one-row prefill written into the
           batch's KV cache at that row: ``insert``)
           run ``steps_per_call`` decode steps for all rows at once (``advance``: one jitted
           ``lax.while_loop`` of :meth:`PlainDecoding.step`, leaving early when every row is
           done)
           hand back each row that finished; its slot is free again

A row's tokens are the tokens plain greedy decoding of that prompt alone gives (tested): each
row attends only to its own cache row, and its positions start at 0. A row that finishes inside
a call waits at most ``steps_per_call - 1`` steps for its slot to be refilled. Prompts are padded
to a power-of-two bucket, so ``insert`` compiles once per bucket.

The KV cache is as long as the longest prompt so far needs (``bucket(prompt + N)`` slots) and
grows, by padding, when a longer one arrives: every step reads every slot of every row, so at
16 rows a 4096-slot cache costs twice a 1024-slot one. Feed prompts shortest first (as
``data regenerate`` does) and the cache grows only when it must; ``advance`` compiles once per
cache size.

With sampling, every row draws from the stream ``fold_in(key, call index)``: valid samples, but
not the ones :func:`~eagle3_jax.decoding.generate` would draw for the same key.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Hashable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.decoding.batching import bucket
from eagle3_jax.decoding.driver import Emitted, GenerationError, eos_tuple
from eagle3_jax.decoding.generate import DecodeState, PlainDecoding
from eagle3_jax.decoding.sampling import SamplingParams
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import Params
from eagle3_jax.model.target import KVCache


@dataclasses.dataclass(frozen=True)
class Finished:
    """One prompt's answer: its id, the generated ids (no EOS), and whether EOS ended it."""

    job: Hashable
    tokens: list[int]
    hit_eos: bool


def _set_row(batch: jax.Array, row: jax.Array, slot: jax.Array) -> jax.Array:
    """``batch`` [B, ...] with row ``slot`` replaced by ``row`` [1, ...]."""
    start = (slot,) + (0,) * (batch.ndim - 1)
    return jax.lax.dynamic_update_slice(batch, row.astype(batch.dtype), start)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnums=(1,))
def _insert(params: Params, state: DecodeState, slot: jax.Array, tokens: jax.Array,
            lengths: jax.Array, key: jax.Array, *, spec: PlainDecoding) -> DecodeState:
    """Prefill one prompt (tokens [1, P], lengths [1]) into row ``slot`` of ``state``."""
    one = spec.prefill(params, tokens, lengths, key)
    put = lambda batch, row: _set_row(batch, row, slot)  # noqa: E731
    cache = KVCache(k=tuple(map(put, state.cache.k, one.cache.k)),
                    v=tuple(map(put, state.cache.v, one.cache.v)),
                    end=put(state.cache.end, one.cache.end))
    out = jax.tree.map(put, state.out, one.out)
    return dataclasses.replace(state, cache=cache, out=out,
                               last_token=put(state.last_token, one.last_token))


@functools.partial(jax.jit, static_argnames=("spec", "steps"), donate_argnums=(1,))
def _advance(params: Params, state: DecodeState, key: jax.Array, *, spec: PlainDecoding,
             steps: int) -> DecodeState:
    """Up to ``steps`` decode steps of every live row (stops early once all rows are done)."""
    state = dataclasses.replace(state, key=key, step=jnp.zeros((), jnp.int32))

    def cond(s):
        return (s.step < steps) & ~jnp.all(s.out.done)

    return jax.lax.while_loop(cond, functools.partial(spec.step, params), state)


class ContinuousDecoder:
    """Plain decoding over ``slots`` rows, each refilled with the next prompt when it finishes.

    Args:
      params, cfg: the target (serving layout).
      slots: rows decoded together (the batch size).
      max_new_tokens: N, the longest answer; a row also ends at an EOS id or a full cache.
      max_prompt_len: the longest prompt that will be given; the cache has
        ``bucket(max_prompt_len + N)`` slots (capped at the context).
      sampling / eos_token_ids: as :func:`~eagle3_jax.decoding.generate`.
      steps_per_call: decode steps between refills.
    """

    def __init__(self, params: Params, cfg: TargetConfig, *, slots: int, max_new_tokens: int,
                 max_prompt_len: int, sampling: SamplingParams = SamplingParams(),
                 eos_token_ids: Sequence[int] = (), steps_per_call: int = 16,
                 pad_id: int = 0):
        context = cfg.max_position_embeddings
        if slots < 1 or max_new_tokens < 1 or steps_per_call < 1 or max_prompt_len < 1:
            raise GenerationError(f"slots ({slots}), max_new_tokens ({max_new_tokens}), "
                                  f"max_prompt_len ({max_prompt_len}) and steps_per_call "
                                  f"({steps_per_call}) must be positive")
        if max_prompt_len + 1 > context:
            raise GenerationError(f"max_prompt_len {max_prompt_len} leaves no room to generate in "
                                  f"the model context of {context} tokens")
        self.params, self.cfg = params, cfg
        self.slots, self.steps_per_call, self.pad_id = slots, steps_per_call, pad_id
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, int(max_new_tokens)
        # The spec of the current cache size (``_grow`` replaces it as the cache grows).
        self.spec = PlainDecoding(cfg, self.max_new_tokens, self._cache_len(1), sampling,
                                  eos_tuple(eos_token_ids))

    def _cache_len(self, prompt_len: int) -> int:
        """Cache slots a prompt of ``prompt_len`` tokens needs: room for N more, bucketed."""
        context = self.cfg.max_position_embeddings
        return min(bucket(prompt_len + self.max_new_tokens, 16, context), context)

    def _grow(self, state: DecodeState, max_len: int) -> DecodeState:
        """``state`` with its cache padded to ``max_len`` slots (the new slots hold nothing)."""
        self.spec = dataclasses.replace(self.spec, max_len=max_len)
        cache = state.cache.resized(max_len)
        return dataclasses.replace(state, cache=cache)

    def _empty_state(self, key: jax.Array) -> DecodeState:
        """Every row done (free). Its key has the run key's type, so the jitted calls see one
        state type and compile once; it is a new array, as the calls donate the state."""
        b, spec = self.slots, self.spec
        out = Emitted.empty(b, spec.max_new_tokens)
        return DecodeState(cache=KVCache.zeros(self.cfg, b, spec.max_len),
                           last_token=jnp.zeros((b,), jnp.int32), step=jnp.zeros((), jnp.int32),
                           out=out.replace(done=jnp.ones((b,), bool)),
                           key=jax.random.split(key)[0])

    def run(self, prompts: Iterable[tuple[Hashable, Sequence[int]]],
            key: jax.Array | None = None) -> Iterator[Finished]:
        """Yield a :class:`Finished` per ``(job, prompt token ids)`` as each answer ends.

        Answers come in finishing order. Pass a ``collections.deque`` to add prompts while
        iterating (the next turn of a conversation, once its answer is in): it is read, from
        the left, whenever a slot is free, and the run ends when it is empty and every slot is
        done. Raises GenerationError for an empty prompt or one longer than ``max_prompt_len``.
        """
        key = jax.random.key(0) if key is None else key
        queue = prompts if isinstance(prompts, collections.deque) else collections.deque(prompts)
        state = self._empty_state(key)
        jobs: list[Hashable | None] = [None] * self.slots
        calls = 0
        while True:
            for slot in range(self.slots):
                if jobs[slot] is None and queue:
                    job, prompt = queue.popleft()
                    state = self._insert(state, slot, prompt, jax.random.fold_in(key, calls))
                    calls += 1
                    jobs[slot] = job
            if all(j is None for j in jobs):
                return
            state = _advance(self.params, state, jax.random.fold_in(key, calls),
                             spec=self.spec, steps=self.steps_per_call)
            calls += 1
            done = np.asarray(state.out.done)
            finished = [s for s in range(self.slots) if jobs[s] is not None and done[s]]
            if not finished:
                continue
            tokens, counts, eos = jax.device_get((state.out.tokens, state.out.num_generated,
                                                  state.out.hit_eos))
            for slot in finished:
                job, jobs[slot] = jobs[slot], None
                yield Finished(job, tokens[slot, :counts[slot]].tolist(), bool(eos[slot]))

    def _insert(self, state: DecodeState, slot: int, prompt: Sequence[int],
                key: jax.Array) -> DecodeState:
        n = len(prompt)
        if n < 1 or n > self.max_prompt_len:
            raise GenerationError(f"prompt of {n} tokens: prompts must have 1 to "
                                  f"max_prompt_len={self.max_prompt_len} tokens")
        if self._cache_len(n) > state.cache.max_len:
            state = self._grow(state, self._cache_len(n))
        width = min(bucket(n, 16, self.max_prompt_len), self.max_prompt_len)
        tokens = np.full((1, width), self.pad_id, np.int32)
        tokens[0, :n] = prompt
        return _insert(self.params, state, jnp.int32(slot), jnp.asarray(tokens),
                       jnp.asarray([n], jnp.int32), key, spec=self.spec)
