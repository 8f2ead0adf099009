"""The target model: config, parameter table (shapes + logical axes), forward, KV cache."""

from eagle3_jax.model.config import ConfigError, RopeScaling, TargetConfig
from eagle3_jax.model.params import (ParamSpec, from_panels, has_panels, init_params,
                                     is_serving, param_bytes, param_specs, serving_specs,
                                     to_panels, to_serving, to_stacked)
from eagle3_jax.model.target import (ForwardOutput, KVCache, causal_mask, forward,
                                     forward_stacked, output_logits, prefill)

__all__ = ["ConfigError", "ForwardOutput", "KVCache", "ParamSpec", "RopeScaling", "TargetConfig",
           "causal_mask", "forward", "forward_stacked", "init_params", "output_logits", "prefill",
           "param_bytes", "param_specs", "is_serving", "serving_specs", "to_serving", "to_stacked",
           "from_panels", "has_panels", "to_panels"]
