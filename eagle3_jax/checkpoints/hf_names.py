"""HF tensor names <-> the target's parameter tree (``eagle3_jax.model.params``).

HF stores linear weights as ``[out, in]``; we store ``[in, out]`` with heads split out, stacked
over layers. ``hf_to_param`` maps one HF tensor to (path in our tree, slot, array in our
per-layer layout); loaders place it at ``[slot]`` of the stacked parameter: the layer index, or
(layer, expert) for one expert of a mixture-of-experts layer (checkpoints hold each expert's
matrices apart: Qwen3-MoE's ``mlp.experts.{e}.gate_proj``, Mixtral's
``block_sparse_moe.experts.{e}.w1``). A Gemma 3 multimodal checkpoint's language model
(``model.language_model.*``, or ``language_model.model.*`` from transformers 4) is read as the
text model; its vision tower is skipped.
"""

from __future__ import annotations

import re

import numpy as np

from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import to_stacked

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
# A multimodal Gemma 3 checkpoint's language-model prefixes -> the text model's.
_LANGUAGE_MODEL = re.compile(r"^(?:model\.language_model\.|language_model\.model\.)")

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

# Gemma's four norms a layer: "post_attention_layernorm" there norms the attention output.
_SANDWICH_NAMES = {
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
}
# One expert's matrix -> our stacked expert weight (Qwen3-MoE names, then Mixtral's).
_EXPERT_NAMES = {"gate_proj": "expert_gate", "up_proj": "expert_up", "down_proj": "expert_down",
                 "w1": "expert_gate", "w3": "expert_up", "w2": "expert_down"}
_ROUTER_NAMES = ("mlp.gate.weight", "block_sparse_moe.gate.weight")

# Tensors HF checkpoints may carry that the forward does not use: rotary buffers, and a
# multimodal Gemma 3's vision tower and projector.
IGNORED = re.compile(r"(rotary_emb\.inv_freq$|^(model\.)?(vision_tower|multi_modal_projector)\.)")


class UnknownTensorError(KeyError):
    pass


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name as a text model's (a multimodal Gemma 3's language-model
    prefix replaced by ``model.``); other names unchanged."""
    return _LANGUAGE_MODEL.sub("model.", name)


def hf_to_param(name: str, array: np.ndarray, cfg: TargetConfig):
    """Map an HF tensor to ``(path, layer, value)``; ``layer`` is None for unstacked params.

    Returns None for tensors to skip (rotary buffers, a tied ``lm_head``).
    Raises UnknownTensorError for a name this architecture does not have.
    """
    n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    if IGNORED.search(name):
        return None
    name = canonical_name(name)
    if name == "model.embed_tokens.weight":
        return ("embed",), None, array
    if name == "model.norm.weight":
        return ("final_norm",), None, array
    if name == "lm_head.weight":
        if cfg.tie_word_embeddings:
            return None
        return ("lm_head",), None, array.T
    m = _LAYER.match(name)
    if not m:
        raise UnknownTensorError(name)
    layer, suffix = int(m.group(1)), m.group(2)
    if cfg.is_moe:
        expert = _EXPERT.match(suffix)
        if expert and expert.group(2) in _EXPERT_NAMES:
            if int(expert.group(1)) >= cfg.num_experts:
                raise UnknownTensorError(name)
            return (("layers", _EXPERT_NAMES[expert.group(2)]), (layer, int(expert.group(1))),
                    array.T)
        if suffix in _ROUTER_NAMES:
            return ("layers", "router"), layer, array
        if suffix.startswith("mlp.") or suffix.startswith("block_sparse_moe."):
            raise UnknownTensorError(name)
    if cfg.sandwich_norms and suffix in _SANDWICH_NAMES:
        return ("layers", _SANDWICH_NAMES[suffix]), layer, array
    if suffix not in _LAYER_NAMES:
        raise UnknownTensorError(name)
    key = _LAYER_NAMES[suffix]
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
    if cfg.sandwich_norms:
        inverse.update({v: s for s, v in _SANDWICH_NAMES.items()})
    moe = "block_sparse_moe" if cfg.arch == "mixtral" else "mlp"
    experts = {"expert_gate": "w1", "expert_up": "w3", "expert_down": "w2"} if cfg.arch == \
        "mixtral" else {"expert_gate": "gate_proj", "expert_up": "up_proj",
                        "expert_down": "down_proj"}
    inverse["router"] = f"{moe}.gate.weight"
    n, h, d = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    params = to_stacked(params, cfg)  # serving params, with or without panels
    out = {"model.embed_tokens.weight": np.asarray(params["embed"]),
           "model.norm.weight": np.asarray(params["final_norm"])}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = np.asarray(params["lm_head"]).T
    for key, stacked in params["layers"].items():
        stacked = np.asarray(stacked)
        for layer in range(cfg.num_layers):
            if key in experts:
                for e in range(cfg.num_experts):
                    out[f"model.layers.{layer}.{moe}.experts.{e}.{experts[key]}.weight"] = \
                        np.ascontiguousarray(stacked[layer, e].T)
                continue
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
