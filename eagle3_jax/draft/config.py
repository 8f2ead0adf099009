"""EAGLE-3 draft-head config: one decoder layer over the target's fused low/mid/high features."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from eagle3_jax.model.config import ConfigError, RopeScaling, TargetConfig


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Hyper-parameters of the draft head (reference §2-4).

    ``hidden_size`` must equal the target's; q/k/v read ``2 * hidden_size`` (embedding and
    feature side by side). ``tap_layers`` are the target layers whose *input* hidden states are
    fused (default ``2, L//2, L-3``). ``ttt_steps`` is K, the number of training-time-test steps.

    EAGLE-3.1 (vLLM, 2026; both off in EAGLE-3 heads): ``fc_norm`` puts an RMSNorm on each of
    the three taps before ``fc``; ``norm_output`` feeds the *normed* output (``final_norm(h)``,
    what ``lm_head`` reads) back as the next step's feature instead of the un-normed ``h``.

    ``norm_before_residual`` (vLLM ``speculators`` heads): the attention's residual is the
    *normed* feature ``hidden_norm(g)`` instead of ``g``. ``rope_scaling``: the head's RoPE
    scaling (llama3 or linear, as the target's), None for plain RoPE at ``rope_theta``.
    """

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    tap_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    ttt_steps: int = 7
    dtype: str = "float32"
    fc_norm: bool = False  # EAGLE-3.1: per-tap RMSNorm before fc
    norm_output: bool = False  # EAGLE-3.1: the normed output is the next step's feature
    norm_before_residual: bool = False  # speculators: residual = hidden_norm(g), not g
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        object.__setattr__(self, "tap_layers", tuple(int(t) for t in self.tap_layers))
        for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                     "vocab_size", "draft_vocab_size", "ttt_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"draft {name} must be a positive integer, got {value!r}")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"draft_vocab_size ({self.draft_vocab_size}) cannot exceed the target vocabulary "
                f"({self.vocab_size})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"draft num_heads ({self.num_heads}) must be a multiple of "
                              f"num_kv_heads ({self.num_kv_heads})")
        if len(self.tap_layers) != 3:
            raise ConfigError(f"EAGLE-3 fuses exactly 3 target layers, got {self.tap_layers}")

    @property
    def num_taps(self) -> int:
        return len(self.tap_layers)

    @classmethod
    def for_target(cls, target: TargetConfig, draft_vocab_size: int | None = None,
                   **overrides: Any) -> "DraftConfig":
        """The default head for ``target``: its width, heads and MLP, taps ``2, L//2, L-3``.

        Every family's head is this dense Llama-style layer, as SpecForge builds it. For a
        mixture of experts its MLP is as wide as the target's ``config.json``
        ``intermediate_size``: Mixtral's expert width; for Qwen3-MoE experts_per_token times the
        expert width (6144 for Qwen3-30B-A3B), the dense size its configs carry."""
        width = target.intermediate_size
        if target.arch == "qwen3_moe":
            width *= target.experts_per_token
        fields = dict(
            hidden_size=target.hidden_size,
            intermediate_size=width,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size or min(target.vocab_size, 32000),
            tap_layers=target.eagle3_tap_layers,
            rms_norm_eps=target.rms_norm_eps,
            dtype=target.dtype,
        )
        fields.update(overrides)
        return cls(**fields)

    def check_fits(self, target: TargetConfig) -> None:
        """Raise ConfigError naming every way this head does not fit ``target``."""
        problems = []
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden size {self.hidden_size} != target's {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocabulary {self.vocab_size} != target's {target.vocab_size}")
        bad = [t for t in self.tap_layers if not 0 <= t < target.num_layers]
        if bad:
            problems.append(f"tap layers {bad} outside the target's {target.num_layers} layers")
        if problems:
            raise ConfigError("draft head does not fit the target: " + "; ".join(problems)
                              + ". Use a head trained for this target.")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DraftConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown draft config keys {unknown}; known: {sorted(known)}")
        data = dict(data)
        if isinstance(data.get("rope_scaling"), Mapping):  # as to_dict writes it
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        return cls(**data)
