"""Decoders: a loaded target (and head) turned into ``generate_batch`` and ``stream`` calls.

A decoder pads prompts, builds its driver spec (:mod:`eagle3_jax.decoding.driver`), compiles
once per shape through an explicit :class:`CompileCache` (shared by the decoders of one process,
e.g. the two of ``--compare``), and draws a fresh key per call from its seed.

* :class:`PlainDecoder`: plain autoregressive decoding.
* :class:`EagleDecoder`: EAGLE-3 speculative decoding with a draft head and a tree, and
  optionally a fallback that gives up drafting where it does not pay
  (:class:`eagle3_jax.decoding.eagle.Fallback`).

A multi-turn chat asks each turn with the earlier turns as history, so turn k's prompt starts
with turn k - 1's prompt and answer. ``generate_batch(..., keep=True)`` leaves each row's KV
caches in its :class:`Generation` (a :class:`CachedPrefix`); given back as a later call's
``prefixes``, the prefill runs only the tokens after the longest common prefix.

``target`` is anything with ``cfg``, ``params`` and ``tokenizer`` (``eos_token_ids``,
``pad_token_id``), e.g. :class:`eagle3_jax.checkpoints.LoadedTarget`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.compile_cache import drop_compiled_programs, memory_mappings, near_mapping_limit
from eagle3_jax.decoding import driver
from eagle3_jax.decoding.acceptance import mean_accept_length
from eagle3_jax.decoding.batching import PaddedPrompts, pad_prompts
from eagle3_jax.decoding.eagle import Fallback, draft_proposer, eagle_decoding
from eagle3_jax.decoding.generate import plain_decoding
from eagle3_jax.decoding.sampling import SamplingParams
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.draft.params import DraftHead


@dataclasses.dataclass
class CachedPrefix:
    """One row's KV caches after a call: ``caches`` (the decoding's ``reusable`` state, batch 1)
    hold the KV of ``token_ids`` (the prompt and the answer, as far as the caches are known to
    hold them), for a later prompt of ``decoder`` that starts with some of them."""

    decoder: str
    token_ids: list[int]
    caches: Any


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


@dataclasses.dataclass
class Generation:
    """One row's result: generated ids (EOS excluded), whether EOS ended it, the wall time of
    the batched call; EAGLE adds its verification rounds, ``accept_hist`` (index j: rounds
    that emitted j tokens), ``plain_steps`` (decode steps where it had given up drafting) and
    ``resumes`` (times drafting resumed after that)."""

    token_ids: list[int]
    hit_eos: bool
    seconds: float
    rounds: int | None = None
    accept_hist: list[int] | None = None
    plain_steps: int = 0
    resumes: int = 0
    prefix: CachedPrefix | None = None  # with generate_batch(..., keep=True)
    reused: int = 0  # prompt tokens taken from a prefix instead of run

    def eagle_fields(self) -> dict:
        if self.rounds is None:
            return {}
        return {"rounds": self.rounds,
                "mean_accept_length": round(mean_accept_length(self.accept_hist), 4),
                "accept_hist": self.accept_hist, "plain_steps": self.plain_steps,
                "resumes": self.resumes}


class CompileCache:
    """Compiled generate functions keyed by everything static about a call.

    ``log(message)`` reports each compilation and its time. Before compiling, where the process
    is near Linux's limit on memory mappings (each compiled program holds some of its own:
    ``eagle3_jax.compile_cache.near_mapping_limit``), every compiled program is dropped first
    (these and JAX's own) and the next call of each compiles again, instead of the compilation
    failing to map its code.
    """

    def __init__(self, log: Callable[[str], None] = lambda message: None):
        self._compiled: dict[Any, Callable] = {}
        self._log = log

    def get(self, key: Any, what: str, shape: tuple[int, int],
            compile_fn: Callable[[], Callable]) -> Callable:
        run = self._compiled.get(key)
        if run is None:
            self._make_room()
            start = time.perf_counter()
            run = self._compiled[key] = compile_fn()
            self._log(f"[compiled {what} for batch {shape[0]} x {shape[1]} prompt slots in "
                      f"{time.perf_counter() - start:.1f} s]")
        return run

    def _make_room(self) -> None:
        near = near_mapping_limit()
        if near is None:
            return
        self._compiled.clear()
        drop_compiled_programs()
        after = memory_mappings()
        self._log(f"[{near[0]} memory mappings of the {near[1]} this process may hold "
                  f"(vm.max_map_count), most of them compiled programs: dropped every compiled "
                  f"program ({after[0] if after else '?'} mappings now); each shape compiles "
                  f"again]")


class PlainDecoder:
    """Plain autoregressive decoding of ``target``."""

    name = "vanilla"
    counts_rounds = False  # stream steps are single tokens, not verification rounds

    def __init__(self, target: Any, sampling: SamplingParams, max_new_tokens: int, seed: int,
                 *, compile_cache: CompileCache | None = None):
        self.target, self.sampling, self.max_new_tokens = target, sampling, max_new_tokens
        self.compile_cache = compile_cache or CompileCache()
        self._key = jax.random.PRNGKey(seed)
        self._calls = 0

    def _next_key(self) -> jax.Array:
        self._calls += 1
        return jax.random.fold_in(self._key, self._calls)

    def _pad(self, prompts: Sequence[list[int]], pad_batch: bool) -> PaddedPrompts:
        return pad_prompts(prompts, pad_id=self.target.tokenizer.pad_token_id,
                           pad_batch=pad_batch,
                           max_length=self.target.cfg.max_position_embeddings)

    def _spec(self, batch: PaddedPrompts):
        """(driver spec, its params) for this padded batch."""
        spec, _, _ = plain_decoding(self.target.cfg, batch.tokens, batch.lengths,
                                    max_new_tokens=self.max_new_tokens, sampling=self.sampling,
                                    eos_token_ids=self.target.tokenizer.eos_token_ids)
        return spec, self.target.params

    def generate_batch(self, prompts: Sequence[list[int]],
                       prefixes: Sequence[CachedPrefix | None] | None = None,
                       keep: bool = False) -> list[Generation]:
        """Every prompt decoded together in one jitted call (padded to a bucketed batch).

        ``prefixes[i]``: an earlier generation's caches (``keep=True``), whose leading tokens
        prompt i's prefill then skips (rows whose prefix is None, of another decoder, or of
        another cache size than the first given start afresh). ``keep``: each generation
        carries its own :class:`CachedPrefix`.
        """
        batch = self._pad(prompts, pad_batch=True)
        spec, params = self._spec(batch)
        shape = batch.tokens.shape
        start = time.perf_counter()
        prefix, reused = self._prefix(spec, batch, prompts, prefixes or [None] * len(prompts))
        assembled = time.perf_counter() - start
        # The params' tree structure carries the head's config (a static field).
        key = (spec, shape, jax.tree.structure(params), keep, jax.tree.structure(prefix),
               tuple(a.shape for a in jax.tree.leaves(prefix)))
        run = self.compile_cache.get(
            key, f"{self.name} generate", shape,
            lambda: driver.compile_run(spec, params, batch.tokens, batch.lengths, prefix,
                                       keep=keep))
        start = time.perf_counter()
        args = (params, batch.tokens, batch.lengths, self._next_key())
        out = run(*args) if prefix is None else run(*args, prefix)
        out, caches = out if keep else (out, None)
        out = jax.device_get(out)
        seconds = time.perf_counter() - start + assembled
        gens = [dataclasses.replace(self._generation(out, i, seconds), reused=reused[i])
                for i in range(batch.num_prompts)]
        if keep:
            slots = jax.device_get(spec.reusable_slots(caches))
            for i, (gen, prompt) in enumerate(zip(gens, prompts)):
                gen.prefix = self._cached_prefix(prompt, gen.token_ids, slots[i],
                                                 jax.tree.map(lambda a, i=i: a[i:i + 1], caches))
        return gens

    def _cached_prefix(self, prompt, token_ids, slots, caches) -> CachedPrefix:
        """A row's caches (batch 1) whose first ``slots`` slots hold its prompt and answer."""
        return CachedPrefix(self.name, (list(prompt) + list(token_ids))[: int(slots)], caches)

    def _prefix(self, spec, batch: PaddedPrompts, prompts: Sequence[list[int]],
                prefixes: Sequence[CachedPrefix | None]) -> tuple[driver.Prefix | None, list]:
        """(the driver's Prefix or None when no row reuses anything, tokens reused per row)."""
        if len(prefixes) != len(prompts):
            raise driver.GenerationError(f"{len(prefixes)} prefixes for {len(prompts)} prompts; "
                                         "give one (or None) per prompt")
        given = [p for p in prefixes if p is not None and p.decoder == self.name]
        if not given:
            return None, [0] * len(prompts)
        like = given[0].caches
        shapes = [a.shape for a in jax.tree.leaves(like)]
        starts, rows = [], []
        for i in range(batch.tokens.shape[0]):
            p = prefixes[i] if i < len(prompts) else None
            fits = (p is not None and p.decoder == self.name
                    and [a.shape for a in jax.tree.leaves(p.caches)] == shapes)
            n = spec.reuse_start(common_prefix(p.token_ids, prompts[i]),
                                 len(prompts[i])) if fits else 0
            starts.append(n)
            rows.append(p.caches if n else jax.tree.map(jnp.zeros_like, like))
        if not any(starts):
            return None, [0] * len(prompts)
        caches = rows[0] if len(rows) == 1 else jax.tree.map(
            lambda *xs: jnp.concatenate(xs), *rows)
        return driver.Prefix(caches, jnp.asarray(starts, jnp.int32)), starts[:len(prompts)]

    def _generation(self, out, i: int, seconds: float) -> Generation:
        return Generation(out.tokens[i, : out.num_generated[i]].tolist(), bool(out.hit_eos[i]),
                          seconds)

    def stream(self, prompt: list[int], prefix: CachedPrefix | None = None
               ) -> Iterator[list[int]]:
        """The tokens of each step (the prefill's first, then one per step or round), from an
        earlier call's caches when ``prefix`` is given; afterwards (also when the caller
        stopped early) :meth:`stream_prefix` keeps this answer's caches for the next turn."""
        batch = self._pad([prompt], pad_batch=False)
        spec, params = self._spec(batch)
        start, self.stream_reused = self._prefix(spec, batch, [prompt], [prefix])
        self._streamed = (spec, list(prompt))
        for rows in driver.stream(spec, params, batch.tokens, batch.lengths, self._next_key(),
                                  on_step=self._on_stream_step, prefix=start):
            yield [int(t) for t in rows[0]]

    def _on_stream_step(self, state) -> None:
        """What a decoder notes about each streamed step: the state, the last one readable."""
        self._stream_state = state

    def stream_prefix(self) -> CachedPrefix:
        """The caches of the last :meth:`stream` as far as it ran, for the next turn's
        ``prefix``."""
        (spec, prompt), state = self._streamed, self._stream_state
        caches = spec.reusable(state)
        out, slots = jax.device_get((state.out, spec.reusable_slots(caches)))
        return self._cached_prefix(prompt, out.tokens[0, : out.num_generated[0]].tolist(),
                                   slots[0], caches)


class EagleDecoder(PlainDecoder):
    """EAGLE-3 speculative decoding (:mod:`eagle3_jax.decoding.eagle`) with ``head`` and
    ``tree``.

    The KV cache holds prompt + max_new_tokens + one tree, capped at the model context; a row
    whose cache cannot take another tree stops there (reported as stop "context").
    """

    name = "eagle"
    counts_rounds = True  # stream steps after the prefill are rounds (plain after a fallback)

    def __init__(self, target: Any, sampling: SamplingParams, max_new_tokens: int, seed: int,
                 *, head: DraftHead, tree: TreeConfig, compile_cache: CompileCache | None = None,
                 fallback: Callable[[int, int], Fallback] | None = None,
                 proposer: Callable = draft_proposer):
        """``fallback(prompt_width, batch) -> Fallback`` (e.g.
        :func:`eagle3_jax.decoding.autotune.fallback_for`): when to give up drafting, per padded
        prompt width and batch; None drafts to the end. ``proposer``: what grows the round's
        tree (``EagleDecoding.proposer``: the head's by default)."""
        super().__init__(target, sampling, max_new_tokens, seed, compile_cache=compile_cache)
        self.head, self.tree, self.fallback = head.serving(), tree, fallback
        self.proposer = proposer

    def _spec(self, batch: PaddedPrompts):
        fallback = self.fallback(*batch.tokens.shape[::-1]) if self.fallback else None
        spec, _, _ = eagle_decoding(self.target.cfg, self.head, batch.tokens, batch.lengths,
                                    max_new_tokens=self.max_new_tokens, tree=self.tree,
                                    sampling=self.sampling,
                                    eos_token_ids=self.target.tokenizer.eos_token_ids,
                                    fallback=fallback, proposer=self.proposer)
        return spec, (self.target.params, self.head)

    def _on_stream_step(self, state) -> None:
        """The streamed prompt's rounds, plain steps and resumes so far (``stream_rounds``,
        ``stream_plain_steps``, ``stream_resumes``): after a fallback gives up, the steps are
        plain ones (and the draft's catch-ups, which emit nothing) until drafting resumes."""
        super()._on_stream_step(state)
        rounds, plain_steps, resumes = jax.device_get(
            (state.rounds[0], state.plain_steps[0], state.resumes[0]))
        self.stream_rounds, self.stream_plain_steps = int(rounds), int(plain_steps)
        self.stream_resumes = int(resumes)

    def _generation(self, out, i: int, seconds: float) -> Generation:
        gen = super()._generation(out, i, seconds)
        return dataclasses.replace(gen, rounds=int(out.rounds[i]),
                                   accept_hist=out.accept_hist[i].tolist(),
                                   plain_steps=int(out.plain_steps[i]),
                                   resumes=int(out.resumes[i]))
