"""The target's parameter pytree: shapes and logical axis names, declared once.

``param_specs(cfg)`` is the single table used to create random parameters, to check and place
loaded checkpoints, and to derive shardings (``eagle3_jax.sharding``). Per-layer weights are
stacked on a leading ``layers`` axis so the forward can ``lax.scan`` over them.

Layout (D hidden, N query heads, K kv heads, H head_dim, F mlp width, V vocab, L layers)::

    embed            [V, D]        ("vocab", "embed")
    layers/attn_norm [L, D]        ("layers", "norm")
    layers/wq        [L, D, N, H]  ("layers", "embed", "q_heads", "head_dim")
    layers/wk, wv    [L, D, K, H]  ("layers", "embed", "kv_heads", "head_dim")
    layers/wo        [L, N, H, D]  ("layers", "q_heads", "head_dim", "embed")
    layers/bq        [L, N, H]     Qwen2 only;  layers/bk, bv [L, K, H]
    layers/q_norm    [L, H]        Qwen3 only;  layers/k_norm [L, H]
    layers/mlp_norm  [L, D]
    layers/w_gate    [L, D, F]     ("layers", "embed", "mlp");  layers/w_up likewise
    layers/w_down    [L, F, D]     ("layers", "mlp", "embed")
    final_norm       [D]           ("norm",)
    lm_head          [D, V]        ("embed", "vocab"), absent when embeddings are tied
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.model.config import TargetConfig

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """Shape, logical axis names and initialiser kind (``"normal"``, ``"ones"``, ``"zeros"``)."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str = "normal"


def param_specs(cfg: TargetConfig) -> Params:
    """Nested dict of :class:`ParamSpec`, the same tree structure as the params."""
    d, f, n, k, h, v, nl = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                            cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.num_layers)
    layers = {
        "attn_norm": ParamSpec((nl, d), ("layers", "norm"), "ones"),
        "wq": ParamSpec((nl, d, n, h), ("layers", "embed", "q_heads", "head_dim")),
        "wk": ParamSpec((nl, d, k, h), ("layers", "embed", "kv_heads", "head_dim")),
        "wv": ParamSpec((nl, d, k, h), ("layers", "embed", "kv_heads", "head_dim")),
        "wo": ParamSpec((nl, n, h, d), ("layers", "q_heads", "head_dim", "embed")),
        "mlp_norm": ParamSpec((nl, d), ("layers", "norm"), "ones"),
        "w_gate": ParamSpec((nl, d, f), ("layers", "embed", "mlp")),
        "w_up": ParamSpec((nl, d, f), ("layers", "embed", "mlp")),
        "w_down": ParamSpec((nl, f, d), ("layers", "mlp", "embed")),
    }
    if cfg.attention_bias:
        layers["bq"] = ParamSpec((nl, n, h), ("layers", "q_heads", "head_dim"), "zeros")
        layers["bk"] = ParamSpec((nl, k, h), ("layers", "kv_heads", "head_dim"), "zeros")
        layers["bv"] = ParamSpec((nl, k, h), ("layers", "kv_heads", "head_dim"), "zeros")
    if cfg.qk_norm:
        layers["q_norm"] = ParamSpec((nl, h), ("layers", "head_dim"), "ones")
        layers["k_norm"] = ParamSpec((nl, h), ("layers", "head_dim"), "ones")
    specs: Params = {
        "embed": ParamSpec((v, d), ("vocab", "embed")),
        "layers": layers,
        "final_norm": ParamSpec((d,), ("norm",), "ones"),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((d, v), ("embed", "vocab"))
    return specs


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def init_params(cfg: TargetConfig, key: jax.Array, scale: float = 0.02) -> Params:
    """Random parameters (normal(0, scale) matrices, unit norms, small random biases).

    Biases and norm scales get a random perturbation too, so tests exercise them.
    Wrap in ``jax.jit(..., out_shardings=...)`` to create them already sharded.
    """
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    dtype = jnp.dtype(cfg.dtype)
    out = []
    for spec, k in zip(leaves, keys):
        noise = jax.random.normal(k, spec.shape, jnp.float32)
        if spec.init == "normal":
            value = noise * scale
        elif spec.init == "ones":
            value = 1.0 + 0.1 * noise
        else:
            value = 0.1 * noise
        out.append(value.astype(dtype))
    return jax.tree.unflatten(treedef, out)


def param_bytes(params: Params) -> int:
    """Total bytes of all parameter arrays."""
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)))
