"""Sampling parameters and the logits transformation shared by plain and speculative decoding.

``adjust_logits`` is the single definition of "the distribution we sample from": temperature,
then top-k, then top-p, in HF's order and with HF's semantics (``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``). A speculative verifier must accept draft tokens
against exactly this distribution, so it calls :func:`probs` rather than re-deriving it.

Greedy decoding is ``temperature == 0``: the adjusted logits keep only the argmax (every other
token is ``-inf``), so ``probs`` is one-hot and ``sample`` is ``argmax`` — the same rules then
hold for greedy and sampled verification.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp

from eagle3_jax.errors import Eagle3Error



class SamplingError(Eagle3Error, ValueError):
    """Sampling parameters that do not describe a distribution; the message says the range."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. Frozen and hashable: a static ``jax.jit`` argument.

    Attributes:
      temperature: 0 means greedy (argmax); > 0 divides the logits.
      top_p: nucleus size in (0, 1]; 1 keeps everything.
      top_k: keep the k most likely tokens; 0 keeps everything.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        t, p, k = self.temperature, self.top_p, self.top_k
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise SamplingError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        # Normalise so equal settings hash equally (1 vs 1.0) and jit caches are shared.
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def sampling_from_flags(temperature: float, top_p: float, top_k: int) -> SamplingParams:
    """SamplingParams from command-line flags; an error names the flag the user typed
    (``--top-p``, not ``top_p``)."""
    try:
        return SamplingParams(temperature, top_p, top_k)
    except SamplingError as e:
        raise SamplingError(re.sub(r"^(temperature|top_p|top_k)",
                                   lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from None


def greedy_argmax(logits: jax.Array) -> jax.Array:
    """The index of the largest logit over the last axis, the lowest on ties: ``jnp.argmax`` for
    finite logits, as plain reductions. XLA CPU runs ``argmax``'s (value, index) reduction
    unvectorised (452 us for [4, 49152]); two reductions over the whole row (max, then the
    least index holding it) write and re-read an index array as large as the logits (266 us
    for [1, 8, 49152], up to 1 ms in an EAGLE round whose caches are cold). Where a power of
    two ``c`` (8..256) divides the vocabulary, the row is read as chunks of ``c``: the chunks'
    maxima, the first chunk holding the top, the first index in it holding the top (122 us).
    Returns int32."""
    vocab = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    chunk = next((c for c in (256, 128, 64, 32, 16, 8) if vocab % c == 0 and vocab > c), None)
    if chunk is None:
        return jnp.minimum(_first_holding(logits, top), vocab - 1)
    chunks = vocab // chunk
    rows = logits.reshape(logits.shape[:-1] + (chunks, chunk))
    at = jnp.minimum(_first_holding(jnp.max(rows, axis=-1), top), chunks - 1)
    held = jnp.take_along_axis(rows, at[..., None, None], axis=-2)[..., 0, :]  # [..., chunk]
    return jnp.minimum(at * chunk + _first_holding(held, top), vocab - 1)


def _first_holding(x: jax.Array, top: jax.Array) -> jax.Array:
    """x [..., n], top [..., 1] -> [...] int32: the least index where x equals top, n if none."""
    n = x.shape[-1]
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == top, index, n), axis=-1)


def adjust_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Apply temperature, top-k and top-p (in that order) to float32 ``logits`` [..., V].

    Removed tokens are set to ``-inf``; the most likely token is always kept. With greedy params
    only the argmax survives (ties resolved to the lowest index, like ``argmax``).
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    if params.greedy:
        best = greedy_argmax(logits)
        keep = jnp.arange(vocab) == best[..., None]
        return jnp.where(keep, logits, -jnp.inf)
    logits = logits / params.temperature
    if 0 < params.top_k < vocab:
        # HF keeps every token >= the k-th largest value (ties at the boundary survive).
        kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]  # [..., 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if params.top_p < 1.0:
        # HF: sort ascending, drop tokens whose ascending cumulative probability <= 1 - top_p,
        # never the last (most likely). Equivalently keep every token >= the smallest survivor.
        ascending = jnp.sort(logits, axis=-1)  # [..., V]
        cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
        removed = cumulative <= 1.0 - params.top_p
        removed = removed.at[..., -1].set(False)
        # Index of the first kept entry in ascending order = number of removed entries.
        first_kept = jnp.sum(removed, axis=-1, keepdims=True)  # [..., 1]
        threshold = jnp.take_along_axis(ascending, first_kept, axis=-1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The sampling distribution [..., V] (float32) that :func:`sample` draws from."""
    return jax.nn.softmax(adjust_logits(logits, params), axis=-1)


def sample(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Draw one token per row from ``logits`` [B, V] -> [B] int32 (argmax when greedy)."""
    if params.greedy:
        return greedy_argmax(logits)
    return jax.random.categorical(key, adjust_logits(logits, params), axis=-1).astype(jnp.int32)
