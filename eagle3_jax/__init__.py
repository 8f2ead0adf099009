"""eagle3_jax: EAGLE-3 speculative decoding in JAX/Flax.

Subpackages, one concern each:
  model/        target architecture config, parameter table, forward pass, KV cache
  sharding/     (data, fsdp, tensor) mesh and logical-axis rules (training / serving)
  checkpoints/  HF safetensors and GGUF loaders, the default model
  text/         tokenizer and chat template
  decoding/     sampling, plain generation, EAGLE tree drafting / verification / generation
  draft/        the EAGLE-3 head, training-time test, released-format export
  train/        the jitted training step, loop, checkpoints, multi-host start-up
  data/         conversations -> tokens with loss masks, draft vocabulary, grain pipeline
  bench/        ``python -m eagle3_jax.bench ...``
"""

__version__ = "0.1.0"
