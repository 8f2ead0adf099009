"""Decoding: sampling rules, prompt batching and plain autoregressive generation."""

from eagle3_jax.decoding.batching import PaddedPrompts, bucket, pad_prompts
from eagle3_jax.decoding.generate import (
    DecodeState, GenerateOutput, cache_size, compile_generate, generate, generate_stream,
)
from eagle3_jax.decoding.sampling import (
    GREEDY, SamplingError, SamplingParams, adjust_logits, probs, sample,
)

__all__ = [
    "GREEDY", "DecodeState", "GenerateOutput", "PaddedPrompts", "SamplingError",
    "SamplingParams", "adjust_logits", "bucket", "cache_size", "compile_generate", "generate",
    "generate_stream", "pad_prompts", "probs", "sample",
]
