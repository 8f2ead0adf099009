"""The decoder's command line (``python -m eagle3_jax.decode``, ``eagle3-decode``).

* :mod:`eagle3_jax.cli.decode`: flags, their checks, loading, ``main``.
* :mod:`eagle3_jax.cli.conversations`: prompts from flags, JSONL or the terminal, turned into
  token ids turn by turn (chat template, system prompt, history, or raw text).
* :mod:`eagle3_jax.cli.output`: what each mode prints (streamed text, JSON lines, a compare).

The decoding itself is the library's (:mod:`eagle3_jax.decoding.decoders`).
"""
