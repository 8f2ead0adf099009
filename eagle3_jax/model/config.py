"""Target-model architecture config: one frozen dataclass for Llama / Mistral / Qwen2 / Qwen3,
Gemma 3 and the mixture-of-experts Qwen3-MoE and Mixtral.

Built from an HF ``config.json`` (:meth:`TargetConfig.from_hf_config`), from GGUF metadata
(``eagle3_jax.checkpoints.gguf_loader``) or from a YAML preset (``eagle3_jax.presets``). Frozen and
hashable, so it can be a static argument of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from eagle3_jax.errors import Eagle3Error

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral")
# HF ``model_type`` -> our ``arch`` (a Gemma 3 multimodal config's text model is read whole).
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                   "gemma3_text": "gemma3", "gemma3": "gemma3", "qwen3_moe": "qwen3_moe",
                   "mixtral": "mixtral"}
FAMILIES = ("Llama 2/3, Vicuna, Mistral, SmolLM2, Qwen2/2.5, Qwen3, Gemma 3, Qwen3-MoE, Mixtral")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")


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
    ``qk_norm`` is Qwen3's and Gemma 3's per-head RMSNorm on q and k. ``dtype`` is the parameter
    and compute dtype (float32 on CPU, bfloat16 on TPU); softmax and norms always run in float32.

    Sliding windows: ``sliding_window`` W set, a token of a *local* layer sees the last W
    positions of its own path (itself included: key position > query position - W).
    ``layer_pattern`` has one character per layer, ``g`` (global: full causal attention) or
    ``l`` (local); empty means every layer global, or every layer local when W is set (Mistral
    v0.1). ``local_rope_theta``: the local layers' RoPE base, unscaled (Gemma 3); None: the
    global RoPE everywhere.

    Gemma 3: ``norm_plus_one`` (RMSNorm scales by 1 + w), ``sandwich_norms`` (attention and
    MLP outputs normed again before the residual add), ``mlp_activation`` ``"gelu_tanh"``,
    ``scale_embeddings`` (embeddings times sqrt(D), rounded to the dtype),
    ``query_pre_attn_scalar`` (scores scaled by its -1/2 power instead of head_dim's) and
    ``final_logit_softcap`` (logits = c * tanh(logits / c)).

    Mixture of experts (``num_experts`` > 0: Qwen3-MoE, Mixtral): every layer's MLP is
    ``num_experts`` SwiGLU experts of width ``intermediate_size``, of which a float32 softmax
    router picks ``experts_per_token`` per token, weighted by their probabilities
    (renormalised over the chosen ones when ``norm_topk_prob``).
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
    sliding_window: int | None = None
    layer_pattern: str = ""
    local_rope_theta: float | None = None
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    mlp_activation: str = "silu"
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    final_logit_softcap: float | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    norm_topk_prob: bool = True
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
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or self.sliding_window <= 0):
            raise ConfigError(f"sliding_window must be a positive integer or null, got "
                              f"{self.sliding_window!r}")
        if self.layer_pattern and (len(self.layer_pattern) != self.num_layers
                                   or set(self.layer_pattern) - {"g", "l"}):
            raise ConfigError(
                f"layer_pattern must have one character per layer ({self.num_layers}), each 'g' "
                f"(global attention) or 'l' (sliding window), got {self.layer_pattern!r}")
        if "l" in self.layer_pattern and self.sliding_window is None:
            raise ConfigError("layer_pattern has local ('l') layers but sliding_window is null; "
                              "set the window")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ConfigError(f"mlp_activation must be one of {MLP_ACTIVATIONS}, got "
                              f"{self.mlp_activation!r}")
        if self.num_experts < 0 or not 0 <= self.experts_per_token <= self.num_experts or (
                self.num_experts and not self.experts_per_token):
            raise ConfigError(
                f"experts_per_token ({self.experts_per_token}) must be in 1..num_experts "
                f"({self.num_experts}) for a mixture-of-experts model, both 0 otherwise")

    def is_local(self, layer: int) -> bool:
        """Whether ``layer`` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return not self.layer_pattern or self.layer_pattern[layer] == "l"

    @property
    def local_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_local(i))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def eagle3_tap_layers(self) -> tuple[int, int, int]:
        """Layers whose *input* hidden states EAGLE-3 fuses: low, mid, high = 2, L//2, L-3."""
        n = self.num_layers
        return (2, n // 2, n - 3)

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied; every expert of an MoE)."""
        return self._count_params(self.num_experts)

    @property
    def num_active_params(self) -> int:
        """Parameters one token's forward reads: ``num_params`` with only the chosen experts."""
        return self._count_params(self.experts_per_token)

    def _count_params(self, experts: int) -> int:
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.attention_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * hd
        mlp = 3 * d * f if not self.is_moe else experts * 3 * d * f
        router = self.num_experts * d
        layer = attn + mlp + router + (4 if self.sandwich_norms else 2) * d
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
        """Build from the dict of an HF ``config.json`` (transformers 4.x or 5.x naming).

        A Gemma 3 multimodal config (``Gemma3ForConditionalGeneration``) gives its text model.
        Options we do not run (another RoPE scaling, attention sinks, chunked or bidirectional
        attention, dense layers among MoE ones, ...) are refused by name."""
        model_type = hf.get("model_type")
        arch = _HF_MODEL_TYPES.get(model_type)
        if arch is None:
            raise ConfigError(
                f"unknown model_type {model_type!r} in config.json; eagle3_jax runs "
                f"{', '.join(ARCHITECTURES)} ({FAMILIES})"
            )
        if model_type == "gemma3":
            hf = _gemma3_text_config(hf.get("text_config") or {})
        elif model_type == "gemma3_text":
            hf = _gemma3_text_config(hf)
        _refuse_unsupported(hf, arch)
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            layers = int(hf["num_hidden_layers"])
            rope = dict(hf.get("rope_parameters") or {})
            local_rope = None
            if arch == "gemma3":
                rope, local_rope = dict(rope["full_attention"]), rope["sliding_attention"]
                if rope_scaling_from_hf(local_rope) is not None:
                    raise ConfigError("RoPE scaling on Gemma 3's local (sliding-window) layers is "
                                      "not supported; only on its global layers")
            scaling_dict = hf.get("rope_scaling") or rope
            theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
            window, pattern = _sliding_window(hf, layers)
            gemma = arch == "gemma3"
            moe = {}
            if arch == "qwen3_moe":
                # The hub's config.json says num_experts; transformers 5 writes num_local_experts.
                moe = dict(num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
                           experts_per_token=int(hf["num_experts_per_tok"]),
                           norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
            elif arch == "mixtral":
                moe = dict(num_experts=int(hf["num_local_experts"]),
                           experts_per_token=int(hf["num_experts_per_tok"]), norm_topk_prob=True)
            width = hf["moe_intermediate_size"] if arch == "qwen3_moe" else hf["intermediate_size"]
            return cls(
                arch=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(width),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                rope_theta=float(theta),
                rope_scaling=rope_scaling_from_hf(scaling_dict),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
                attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
                qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
                sliding_window=window,
                layer_pattern=pattern,
                local_rope_theta=float(local_rope["rope_theta"]) if local_rope else None,
                norm_plus_one=gemma,
                sandwich_norms=gemma,
                mlp_activation="gelu_tanh" if gemma else "silu",
                scale_embeddings=gemma,
                query_pre_attn_scalar=(float(hf["query_pre_attn_scalar"]) if gemma else None),
                final_logit_softcap=(float(hf["final_logit_softcapping"])
                                     if hf.get("final_logit_softcapping") else None),
                dtype=dtype,
                **moe,
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing the key {e.args[0]!r}") from None


def _gemma3_text_config(text: Mapping[str, Any]) -> dict[str, Any]:
    """A Gemma 3 text config (a multimodal ``config.json``'s ``text_config``, or a text model's)
    as transformers 5 writes it: the defaults filled in for keys the hub files leave out, and
    the older keys (``sliding_window_pattern``, ``rope_local_base_freq``, ``rope_scaling``)
    turned into ``layer_types`` and per-kind ``rope_parameters``."""
    import transformers  # the config class holds Gemma 3's defaults; imported only here

    return transformers.Gemma3TextConfig(**{k: v for k, v in text.items()
                                            if k != "model_type"}).to_dict()


def _sliding_window(hf: Mapping[str, Any], layers: int) -> tuple[int | None, str]:
    """(window, layer_pattern) of an HF config: ``layer_types`` when given, else every layer
    local when ``sliding_window`` is set (and ``use_sliding_window`` is not false)."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    types = hf.get("layer_types")
    if window is None:
        return None, ""
    if not types:
        return int(window), ""
    kinds = {"full_attention": "g", "sliding_attention": "l"}
    unknown = sorted(set(types) - set(kinds))
    if unknown:
        raise ConfigError(f"attention layer types {unknown} are not supported; eagle3_jax runs "
                          "full_attention and sliding_attention layers")
    if len(types) != layers:
        raise ConfigError(f"layer_types lists {len(types)} layers, not num_hidden_layers "
                          f"({layers})")
    pattern = "".join(kinds[t] for t in types)
    return (int(window), pattern) if "l" in pattern else (None, "")


def _refuse_unsupported(hf: Mapping[str, Any], arch: str) -> None:
    """Refuse, by name, config options the forward would otherwise silently ignore."""
    if hf.get("attn_logit_softcapping"):
        raise ConfigError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("bidirectional attention (use_bidirectional_attention) is not supported")
    for key in ("sinks", "attention_sinks", "use_sinks"):
        if hf.get(key):
            raise ConfigError(f"attention sinks ({key}) are not supported")
    if hf.get("attention_chunk_size"):
        raise ConfigError("chunked attention (attention_chunk_size) is not supported")
    if arch == "qwen3_moe":
        if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
            raise ConfigError("Qwen3-MoE with dense layers among the expert ones (mlp_only_layers, "
                              "decoder_sparse_step) is not supported; every layer must be MoE")
        if hf.get("shared_expert_intermediate_size"):
            raise ConfigError("shared experts (shared_expert_intermediate_size) are not supported")
    if arch in ("gemma3", "llama", "mistral", "qwen2", "qwen3") and (
            hf.get("num_experts") or hf.get("num_local_experts")):
        raise ConfigError(f"a {arch} config with num_experts is not a model eagle3_jax knows")
    activation = hf.get("hidden_activation") or hf.get("hidden_act")
    expected = "gelu_pytorch_tanh" if arch == "gemma3" else "silu"
    if activation and activation != expected:
        raise ConfigError(f"MLP activation {activation!r} is not supported for {arch}; it uses "
                          f"{expected!r}")


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
    raise ConfigError(f"RoPE scaling type {kind!r} is not supported (supported: llama3, linear); "
                      "use a checkpoint without it")
