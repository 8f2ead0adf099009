"""Target-model architecture config: one frozen dataclass for Llama / Mistral / Qwen2 / Qwen3.

Built from an HF ``config.json`` (:meth:`TargetConfig.from_hf_config`), from GGUF metadata
(``eagle3_jax.checkpoints.gguf_loader``) or from a YAML preset (``eagle3_jax.presets``). Frozen and
hashable, so it can be a static argument of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from eagle3_jax.errors import Eagle3Error

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


class ConfigError(Eagle3Error, ValueError):
    """A config that cannot describe a model we can run; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is ``"llama3"`` or ``"linear"``."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.kind not in ("llama3", "linear"):
            raise ConfigError(
                f"rope scaling type {self.kind!r} is not supported; supported: 'llama3', 'linear'"
            )
        if self.factor <= 0:
            raise ConfigError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Decoder-only transformer hyper-parameters.

    Attributes mirror HF names where one exists. ``attention_bias`` is Qwen2's q/k/v bias,
    ``qk_norm`` is Qwen3's per-head RMSNorm on q and k. ``dtype`` is the parameter and compute
    dtype (float32 on CPU, bfloat16 on TPU); softmax and norms always run in float32.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    dtype: str = "float32"

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {self.arch!r}; eagle3_jax runs {', '.join(ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def eagle3_tap_layers(self) -> tuple[int, int, int]:
        """Layers whose *input* hidden states EAGLE-3 fuses: low, mid, high = 2, L//2, L-3."""
        n = self.num_layers
        return (2, n // 2, n - 3)

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.attention_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * hd
        layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * layer + d + head

    def replace(self, **changes: Any) -> "TargetConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TargetConfig":
        """Inverse of :meth:`to_dict`; unknown keys are refused by name."""
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown target config keys {unknown}; known keys: {sorted(known)}")
        scaling = data.get("rope_scaling")
        if isinstance(scaling, Mapping):
            data["rope_scaling"] = RopeScaling(**scaling)
        try:
            return cls(**data)
        except TypeError as e:  # missing required field
            raise ConfigError(f"incomplete target config: {e}") from None

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], dtype: str = "float32") -> "TargetConfig":
        """Build from the dict of an HF ``config.json`` (transformers 4.x or 5.x naming)."""
        model_type = hf.get("model_type")
        arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}.get(
            model_type
        )
        if arch is None:
            raise ConfigError(
                f"unknown model_type {model_type!r} in config.json; eagle3_jax runs "
                f"{', '.join(ARCHITECTURES)} "
                "(Llama 2/3, Vicuna, Mistral, SmolLM2, Qwen2/2.5, Qwen3)"
            )
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            rope = dict(hf.get("rope_parameters") or {})
            scaling_dict = hf.get("rope_scaling") or rope
            theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
            sliding = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
            if sliding is not None and int(sliding) < int(hf.get("max_position_embeddings", 0)):
                raise ConfigError(
                    f"sliding-window attention (window {sliding}) is not supported; use a model "
                    "without it (Mistral v0.2+ sets sliding_window to null)"
                )
            return cls(
                arch=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                rope_theta=float(theta),
                rope_scaling=rope_scaling_from_hf(scaling_dict),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
                qk_norm=arch == "qwen3",
                dtype=dtype,
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing the key {e.args[0]!r}") from None


def rope_scaling_from_hf(scaling: Mapping[str, Any] | None) -> RopeScaling | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                scaling.get("original_max_position_embeddings", 8192)
            ),
        )
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(scaling["factor"]))
    raise ConfigError(f"rope scaling type {kind!r} is not supported; supported: llama3, linear")
