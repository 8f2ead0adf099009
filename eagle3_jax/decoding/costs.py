"""Measured costs on this machine: target forwards over T new tokens, draft steps, timing.

The tree chooser (:mod:`eagle3_jax.decoding.autotune`) and the benchmarks
(``python -m eagle3_jax.bench forward``) time the same functions, defined here:

* :func:`forward_curve`: median seconds of one target forward over T new tokens appended after
  ``context`` cached tokens (T = 1 is plain decoding's step), for a batch of rows, optionally
  with the per-token time of a jitted greedy decode loop (:func:`decode_loop`).
* :func:`measure_draft_steps`: median seconds of one draft step over w tokens (per row of a
  batch).
* :func:`measure_round`: median seconds of one whole EAGLE round (draft the tree, verify,
  accept, commit) of each of several trees against one whole plain decode step, as the
  decoding loops run them, all interleaved.
* :func:`interleaved_medians`: named functions run round-robin, so machine noise hits all alike.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from eagle3_jax.decoding.sampling import greedy_argmax
from eagle3_jax.draft.model import draft_step_cached, empty_draft_cache
from eagle3_jax.kernels.matmul import weight_rows
from eagle3_jax.model.target import KVCache, causal_mask, forward
from eagle3_jax.sharding import replicated_like


def time_call(fn: Callable[[], object]) -> float:
    """Seconds for one call, waiting for every device result."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def interleaved_medians(fns: Mapping[str, Callable[[], object]], repeats: int,
                        warmup: int = 1) -> dict[str, float]:
    """Median seconds per named function, run round-robin so machine noise hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            time_call(fn)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(time_call(fn))
    return {name: statistics.median(s) for name, s in samples.items()}


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def forward_step(params, cache, tokens, cfg):
    """T new tokens appended at cache.end: the decode / verification forward."""
    t = tokens.shape[1]
    positions = cache.end[:, None] + jnp.arange(t)[None]
    out = forward(params, cfg, tokens, positions, causal_mask(cache.end, t, cache.max_len), cache)
    return out.logits, out.cache


LOOP_STEPS = 16


@functools.partial(jax.jit, static_argnames=("cfg", "steps"), donate_argnames=("cache",))
def decode_loop(params, cache, token, cfg, steps):
    """``steps`` greedy decode steps from ``cache`` in one ``lax.fori_loop``; token [B, 1].

    Returns (last token [B, 1], cache with ``end`` moved back to where it started, so the next
    call decodes over the same context length).
    """
    start = cache.end

    def step(_, carry):
        token, cache = carry
        logits, cache = forward_step(params, cache, token, cfg)
        token = greedy_argmax(logits[:, -1:])
        return token, cache.replace(end=cache.end + 1)

    token, cache = jax.lax.fori_loop(0, steps, step, (token, cache))
    return token, cache.replace(end=start)


def forward_curve(params, cfg, context: int, sizes, repeats: int,
                  loop_steps: int = 0, batch: int = 1) -> dict[int | str, float]:
    """Median seconds of a forward over ``T in sizes`` new tokens after ``context`` cached, for
    ``batch`` rows; with ``loop_steps``, also the seconds per token of :func:`decode_loop`
    (key "loop", batch 1)."""
    max_len = context + max(max(sizes), loop_steps)
    caches = {}
    fns = {}

    def fresh(rows: int, width: int):
        """(a cache of ``rows`` at ``context``, ``width`` new tokens a row), on the weights'
        mesh, where the cache each call returns lies: one program per shape, not two."""
        cache = KVCache.zeros(cfg, rows, max_len).replace(
            end=jnp.full((rows,), context, jnp.int32))
        return replicated_like((cache, jnp.ones((rows, width), jnp.int32)), params)

    for t in sizes:
        caches[t], tokens = fresh(batch, t)

        def run(t=t, tokens=tokens):
            logits, caches[t] = forward_step(params, caches[t], tokens, cfg)
            return logits
        fns[t] = run
    if loop_steps:
        caches["loop"], first = fresh(1, 1)

        def loop():
            token, caches["loop"] = decode_loop(params, caches["loop"], first, cfg, loop_steps)
            return token
        fns["loop"] = loop
    medians = interleaved_medians(fns, repeats, warmup=2)
    if loop_steps:
        medians["loop"] /= loop_steps
    return medians


def measure_draft_steps(head, embed, context: int, widths: Sequence[int],
                        repeats: int, batch: int = 1) -> dict[int, float]:
    """Median seconds of one draft step over w tokens per row, ``batch`` rows, after
    ``context`` cached entries (the head in the serving layout decoding runs)."""
    head = head.serving()
    dcfg = head.cfg
    slots = context + max(widths)
    cache_k, cache_v = empty_draft_cache(dcfg, batch, slots)
    step = jax.jit(functools.partial(draft_step_cached, cfg=dcfg))
    fns = {}
    for w in widths:
        # The lookup outside the timed call: eagerly, a lookup from panels is several
        # dispatched ops (~2 ms); inside the decoding loop it is part of the jitted step.
        embeds = weight_rows(embed, jnp.ones((batch, w), jnp.int32))
        g = jnp.zeros((batch, w, dcfg.hidden_size), jnp.dtype(dcfg.dtype))
        pos = jnp.broadcast_to(context + jnp.arange(w, dtype=jnp.int32)[None], (batch, w))
        mask = jnp.arange(slots)[None, None, :] <= pos[:, :, None]

        def run(embeds=embeds, g=g, pos=pos, mask=mask):
            return step(head.params, embeds=embeds, g=g, positions=pos,
                        mask=mask, cache_k=cache_k, cache_v=cache_v, write_slots=pos)
        fns[w] = run
    return interleaved_medians(fns, repeats, warmup=1)


def measure_round(target_params, cfg, head, trees: Sequence, context: int, repeats: int,
                  batch: int = 1) -> list[dict[str, float]]:
    """Median seconds of one EAGLE round of each of ``trees`` ("round": the decoding loop's
    whole step: draft the tree, verify, accept, commit the path, catch the draft up) and of one
    plain decode step ("step", the plain loop's, the same for all), for ``batch`` rows of
    ``context`` prompt tokens, all interleaved, so a slow spell of the machine hits every tree
    alike. A round's time over the step's is the tokens it must emit to pay: what the model of
    :mod:`eagle3_jax.decoding.autotune` leaves out (the round's own work) included."""
    from eagle3_jax.decoding import driver
    from eagle3_jax.decoding.eagle import eagle_decoding
    from eagle3_jax.decoding.generate import plain_decoding

    # Room for every timed call's tokens where the model's context allows (a row that stops
    # early still runs through both loops' steps: the shapes are static).
    widest = max(tree.total_tokens + tree.depth + 2 for tree in trees)
    room = cfg.max_position_embeddings - widest
    max_new = min((repeats + 3) * (max(tree.depth for tree in trees) + 1) + 2,
                  max(room // 2, 1))
    context = max(1, min(int(context), room - max_new))
    tokens = jnp.ones((batch, context), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    key = jax.random.PRNGKey(0)
    head = head.serving()
    plain, _, _ = plain_decoding(cfg, tokens, lengths, max_new_tokens=max_new)
    runs = {"step": (plain, target_params)}
    for i, tree in enumerate(trees):
        eagle, _, _ = eagle_decoding(cfg, head, tokens, lengths, max_new_tokens=max_new,
                                     tree=tree)
        runs[i] = (eagle, (target_params, head))
    states = {name: driver.start(spec, params, tokens, lengths, key)
              for name, (spec, params) in runs.items()}

    def call(name):
        spec, params = runs[name]
        states[name] = driver.advance(spec, params, states[name])
        return states[name].out.num_generated

    times = interleaved_medians({name: functools.partial(call, name) for name in runs}, repeats,
                                warmup=2)
    return [{"round": times[i], "step": times["step"]} for i in range(len(trees))]
