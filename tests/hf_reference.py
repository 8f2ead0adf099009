"""Tiny random HF transformers models as an independent reference for the JAX target.

``tiny_hf_model(arch, ...)`` builds a float32, eval-mode torch model whose weights are all random
(norm scales and biases included, so that they matter), and ``params_from_hf`` converts its state
dict into our parameter tree through ``eagle3_jax.checkpoints.hf_names.hf_to_param``, the same
mapping the checkpoint loader uses. Test modules import these helpers; nothing here is a test.

Weight scales are chosen so activations stay O(1): matrices ~ N(0, 1/fan_in), embeddings
~ N(0, 1/D) (so a tied head also gives logits of std ~1), norm scales 1 + N(0, 0.1^2),
biases N(0, 0.1^2). Fixed test tolerances are then meaningful in absolute terms.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from eagle3_jax.checkpoints.hf_names import hf_to_param
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import is_spec, param_specs

# One torch thread for the references: they are small, and the suite runs a pytest worker on
# each core, where a second torch thread spinning against the other worker slows both.
torch.set_num_threads(1)

# Small defaults shared by every architecture. 7 layers so the EAGLE-3 taps (2, L//2, L-3) =
# (2, 3, 4) are three distinct layers, none of them the first or the last.
TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=7,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

_CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "gemma3": transformers.Gemma3TextConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "mixtral": transformers.MixtralConfig,
}
# Each family's own small defaults on top of TINY: Gemma 3 with a window of 8 over prompts of
# 24 (layer 5 of 7 global, the rest local), a query scalar apart from head_dim and linear RoPE
# scaling on its global layers; the MoEs with 8 (Qwen3) or 4 (Mixtral) experts of width 16.
_FAMILY = {
    "mistral": dict(sliding_window=None),  # full attention; the window cases set one
    "qwen3": dict(head_dim=12),  # explicit head_dim != hidden / heads (= 8)
    "gemma3": dict(head_dim=8, sliding_window=8, query_pre_attn_scalar=12,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 100000.0},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0}}),
    "qwen3_moe": dict(head_dim=12, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=16, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16,
                    sliding_window=None),
}


def hf_config(arch: str, **overrides: Any) -> transformers.PretrainedConfig:
    """A tiny HF config of ``arch`` (a key of ``_CONFIG_CLASSES``)."""
    kwargs = {**TINY, **_FAMILY.get(arch, {})}
    kwargs.update(overrides)
    return _CONFIG_CLASSES[arch](**kwargs)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with O(1)-activation random values (see module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # tied weights appear once
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            value = 0.1 * noise
        else:  # [out, in] (per expert: [E, out, in]), or the embedding [V, D]: 1 / fan_in
            value = noise / math.sqrt(p.shape[-1])
        p.copy_(value.to(p.dtype))


def build_hf_model(config: transformers.PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """Float32 eval-mode ``AutoModelForCausalLM`` with random weights, eager attention."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    randomize_(model, seed)
    return model.eval()


def read_checkpoint(folder) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors files in ``folder``, as stored (bfloat16 stays so)."""
    from safetensors.numpy import load_file

    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(path))
    return out


def checkpoint_state(model: torch.nn.Module, cfg: TargetConfig) -> dict[str, Any]:
    """``model``'s tensors by their checkpoint names: its state dict, or for a mixture of
    experts (whose torch module fuses the experts, where checkpoints hold each apart) what
    ``save_pretrained`` writes, read back as float32 numpy."""
    if not cfg.is_moe:
        return model.state_dict()
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return {name: np.asarray(a, np.float32) for name, a in read_checkpoint(folder).items()}


def params_from_hf(state_dict: dict[str, Any], cfg: TargetConfig) -> dict:
    """Convert an HF state dict into our parameter tree via ``hf_to_param``.

    Every parameter slot (each layer of each stacked weight) must be written exactly once;
    shapes are checked against ``param_specs(cfg)``.
    """
    specs = param_specs(cfg)
    arrays = jax.tree.map(lambda s: np.empty(s.shape, np.float32), specs, is_leaf=is_spec)
    written: set[tuple] = set()
    for name, tensor in state_dict.items():
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.detach().to(torch.float32).numpy()
        mapped = hf_to_param(name, tensor, cfg)
        if mapped is None:
            continue
        path, layer, value = mapped
        target = arrays
        for key in path[:-1]:
            target = target[key]
        slot = (path, layer)
        assert slot not in written, f"{name} writes {slot} a second time"
        written.add(slot)
        if layer is None:
            assert value.shape == target[path[-1]].shape, (name, value.shape)
            target[path[-1]] = np.asarray(value, np.float32)
        else:
            lead = len(layer) if isinstance(layer, tuple) else 1  # (layer, expert) or layer
            assert value.shape == target[path[-1]].shape[lead:], (name, value.shape)
            target[path[-1]][layer] = value
    # Every slot written: a whole leaf, or each layer (and expert) of a stacked leaf.
    for keys, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        path = tuple(k.key for k in keys)
        slots = list(range(len(leaf)))
        if path[-1].startswith("expert_"):
            slots = [(i, e) for i in range(leaf.shape[0]) for e in range(leaf.shape[1])]
        assert (path, None) in written or all((path, i) in written for i in slots), (
            f"the HF state dict did not write the parameter {'/'.join(path)}")
    return jax.tree.map(lambda a: jnp.asarray(a, dtype=cfg.dtype), arrays)


def tiny_hf_model(arch: str, seed: int = 0, **overrides: Any):
    """``(hf_model, cfg, params)``: a random HF model, its TargetConfig and our params."""
    model = build_hf_model(hf_config(arch, **overrides), seed)
    cfg = TargetConfig.from_hf_config(model.config.to_dict())
    return model, cfg, params_from_hf(checkpoint_state(model, cfg), cfg)


@torch.no_grad()
def hf_forward(model: torch.nn.Module, tokens: np.ndarray, position_ids: np.ndarray | None = None):
    """HF logits [B, T, V] and hidden states (L+1 arrays [B, T, D]) as float32 numpy."""
    kwargs = {}
    if position_ids is not None:
        kwargs["position_ids"] = torch.as_tensor(np.array(position_ids), dtype=torch.long)
    out = model(
        input_ids=torch.as_tensor(np.array(tokens), dtype=torch.long),
        output_hidden_states=True,
        use_cache=False,
        **kwargs,
    )
    return out.logits.float().numpy(), [h.float().numpy() for h in out.hidden_states]
