"""HF tensor names <-> the target's parameter tree (``eagle3_jax.model.params``).

HF stores linear weights as ``[out, in]``; we store ``[in, out]`` with heads split out, stacked
over layers. ``hf_to_param`` maps one HF tensor to (path in our tree, layer index or None, array in
our per-layer layout); loaders place it at ``[layer]`` of the stacked parameter.
"""

from __future__ import annotations

import re

import numpy as np

from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import to_stacked

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# HF per-layer suffix -> our layer key.
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}

# Tensors HF checkpoints may carry that the forward does not use.
IGNORED = re.compile(r"(rotary_emb\.inv_freq$)")


class UnknownTensorError(KeyError):
    pass


def hf_to_param(name: str, array: np.ndarray, cfg: TargetConfig):
    """Map an HF tensor to ``(path, layer, value)``; ``layer`` is None for unstacked params.

    Returns None for tensors to skip (rotary buffers, a tied ``lm_head``).
    Raises UnknownTensorError for a name this architecture does not have.
    """
    n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    if IGNORED.search(name):
        return None
    if name == "model.embed_tokens.weight":
        return ("embed",), None, array
    if name == "model.norm.weight":
        return ("final_norm",), None, array
    if name == "lm_head.weight":
        if cfg.tie_word_embeddings:
            return None
        return ("lm_head",), None, array.T
    m = _LAYER.match(name)
    if not m or m.group(2) not in _LAYER_NAMES:
        raise UnknownTensorError(name)
    layer, key = int(m.group(1)), _LAYER_NAMES[m.group(2)]
    if key in ("wq", "wk", "wv"):
        heads = n if key == "wq" else k
        value = array.T.reshape(d, heads, h)
    elif key == "wo":
        value = array.T.reshape(n, h, d)
    elif key in ("bq", "bk", "bv"):
        value = array.reshape(n if key == "bq" else k, h)
    elif key in ("w_gate", "w_up", "w_down"):
        value = array.T
    else:
        value = array
    return ("layers", key), layer, value


def param_to_hf(cfg: TargetConfig, params) -> dict[str, np.ndarray]:
    """Inverse of :func:`hf_to_param`: our tree -> HF-named ``[out, in]`` numpy arrays."""
    inverse = {v: s for s, v in _LAYER_NAMES.items()}
    n, h, d = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    params = to_stacked(params, cfg)  # serving params, with or without panels
    out = {"model.embed_tokens.weight": np.asarray(params["embed"]),
           "model.norm.weight": np.asarray(params["final_norm"])}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = np.asarray(params["lm_head"]).T
    for key, stacked in params["layers"].items():
        stacked = np.asarray(stacked)
        for layer in range(cfg.num_layers):
            value = stacked[layer]
            if key in ("wq", "wk", "wv"):
                value = value.reshape(d, -1).T
            elif key == "wo":
                value = value.reshape(n * h, d).T
            elif key in ("bq", "bk", "bv"):
                value = value.reshape(-1)
            elif key in ("w_gate", "w_up", "w_down"):
                value = value.T
            out[f"model.layers.{layer}.{inverse[key]}"] = np.ascontiguousarray(value)
    return out
