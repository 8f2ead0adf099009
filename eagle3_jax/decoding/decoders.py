"""Decoders: a loaded target (and head) turned into ``generate_batch`` and ``stream`` calls.

A decoder pads prompts, builds its driver spec (:mod:`eagle3_jax.decoding.driver`), compiles
once per shape through an explicit :class:`CompileCache` (shared by the decoders of one process,
e.g. the two of ``--compare``), and draws a fresh key per call from its seed.

* :class:`PlainDecoder`: plain autoregressive decoding.
* :class:`EagleDecoder`: EAGLE-3 speculative decoding with a draft head and a tree, and
  optionally a fallback that gives up drafting where it does not pay
  (:class:`eagle3_jax.decoding.eagle.Fallback`).

``target`` is anything with ``cfg``, ``params`` and ``tokenizer`` (``eos_token_ids``,
``pad_token_id``), e.g. :class:`eagle3_jax.checkpoints.LoadedTarget`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterator, Sequence

import jax

from eagle3_jax.decoding import driver
from eagle3_jax.decoding.acceptance import mean_accept_length
from eagle3_jax.decoding.batching import PaddedPrompts, pad_prompts
from eagle3_jax.decoding.eagle import Fallback, eagle_decoding
from eagle3_jax.decoding.generate import plain_decoding
from eagle3_jax.decoding.sampling import SamplingParams
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.draft.params import DraftHead


@dataclasses.dataclass
class Generation:
    """One row's result: generated ids (EOS excluded), whether EOS ended it, the wall time of
    the batched call; EAGLE adds its verification rounds, ``accept_hist`` (index j: rounds
    that emitted j tokens) and ``plain_steps`` (decode steps after it gave up drafting)."""

    token_ids: list[int]
    hit_eos: bool
    seconds: float
    rounds: int | None = None
    accept_hist: list[int] | None = None
    plain_steps: int = 0

    def eagle_fields(self) -> dict:
        if self.rounds is None:
            return {}
        return {"rounds": self.rounds,
                "mean_accept_length": round(mean_accept_length(self.accept_hist), 4),
                "accept_hist": self.accept_hist, "plain_steps": self.plain_steps}


class CompileCache:
    """Compiled generate functions keyed by everything static about a call.

    ``log(message)`` reports each compilation and its time.
    """

    def __init__(self, log: Callable[[str], None] = lambda message: None):
        self._compiled: dict[Any, Callable] = {}
        self._log = log

    def get(self, key: Any, what: str, shape: tuple[int, int],
            compile_fn: Callable[[], Callable]) -> Callable:
        run = self._compiled.get(key)
        if run is None:
            start = time.perf_counter()
            run = self._compiled[key] = compile_fn()
            self._log(f"[compiled {what} for batch {shape[0]} x {shape[1]} prompt slots in "
                      f"{time.perf_counter() - start:.1f} s]")
        return run


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

    def generate_batch(self, prompts: Sequence[list[int]]) -> list[Generation]:
        """Every prompt decoded together in one jitted call (padded to a bucketed batch)."""
        batch = self._pad(prompts, pad_batch=True)
        spec, params = self._spec(batch)
        shape = batch.tokens.shape
        # The params' tree structure carries the head's config (a static field).
        run = self.compile_cache.get(
            (spec, shape, jax.tree.structure(params)), f"{self.name} generate", shape,
            lambda: driver.compile_run(spec, params, batch.tokens, batch.lengths))
        start = time.perf_counter()
        out = jax.device_get(run(params, batch.tokens, batch.lengths, self._next_key()))
        seconds = time.perf_counter() - start
        return [self._generation(out, i, seconds) for i in range(batch.num_prompts)]

    def _generation(self, out, i: int, seconds: float) -> Generation:
        return Generation(out.tokens[i, : out.num_generated[i]].tolist(), bool(out.hit_eos[i]),
                          seconds)

    def stream(self, prompt: list[int]) -> Iterator[list[int]]:
        """The tokens of each step (the prefill's first, then one per step or round)."""
        batch = self._pad([prompt], pad_batch=False)
        spec, params = self._spec(batch)
        for rows in driver.stream(spec, params, batch.tokens, batch.lengths, self._next_key(),
                                  on_step=self._on_stream_step):
            yield [int(t) for t in rows[0]]

    def _on_stream_step(self, state) -> None:
        """What a decoder notes about each streamed step (nothing here)."""


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
                 fallback: Callable[[int, int], Fallback] | None = None):
        """``fallback(prompt_width, batch) -> Fallback`` (e.g.
        :func:`eagle3_jax.decoding.autotune.fallback_for`): when to give up drafting, per padded
        prompt width and batch; None drafts to the end."""
        super().__init__(target, sampling, max_new_tokens, seed, compile_cache=compile_cache)
        self.head, self.tree, self.fallback = head.serving(), tree, fallback

    def _spec(self, batch: PaddedPrompts):
        fallback = self.fallback(*batch.tokens.shape[::-1]) if self.fallback else None
        spec, _, _ = eagle_decoding(self.target.cfg, self.head, batch.tokens, batch.lengths,
                                    max_new_tokens=self.max_new_tokens, tree=self.tree,
                                    sampling=self.sampling,
                                    eos_token_ids=self.target.tokenizer.eos_token_ids,
                                    fallback=fallback)
        return spec, (self.target.params, self.head)

    def _on_stream_step(self, state) -> None:
        """The streamed prompt's rounds and plain steps so far (``stream_rounds``,
        ``stream_plain_steps``): after a fallback the steps are no longer rounds."""
        rounds, plain_steps = jax.device_get((state.rounds[0], state.plain_steps[0]))
        self.stream_rounds, self.stream_plain_steps = int(rounds), int(plain_steps)

    def _generation(self, out, i: int, seconds: float) -> Generation:
        gen = super()._generation(out, i, seconds)
        return dataclasses.replace(gen, rounds=int(out.rounds[i]),
                                   accept_hist=out.accept_hist[i].tolist(),
                                   plain_steps=int(out.plain_steps[i]))
