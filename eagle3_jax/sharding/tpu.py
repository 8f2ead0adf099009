"""Cloud TPU slices by name, and an analytic mesh plan for training or decoding a target on one.

Topologies are named as Cloud TPU names accelerator types: ``v4-32``, ``v5p-16`` (the number
counts TensorCores, two per chip), ``v5litepod-8`` or ``v5e-8``, ``v6e-4`` (the number counts
chips). :func:`mesh_plan` picks the (data, fsdp, tensor) mesh and estimates the HBM each chip
needs from the model's sizes alone:

* decoding (serving layout): bfloat16 weights sharded over the smallest ``tensor`` that leaves
  room for the KV cache, replicas over ``data``;
* training (``target_sharding: training``): everything FSDP-sharded over all chips: the frozen
  target in its dtype, the head's float32 master weights, gradients and two AdamW moments, plus
  an activation estimate per token.

It is an estimate: where libtpu is installed, compiling the step for the topology gives the
real figure (XLA's memory analysis).
"""

from __future__ import annotations

import dataclasses
import re

from eagle3_jax.model.config import TargetConfig
from eagle3_jax.sharding.mesh import MeshConfig, MeshError

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class TpuChip:
    generation: str
    hbm_bytes: int              # per chip
    bf16_flops: float           # peak dense bfloat16 FLOP/s per chip
    cores_per_chip: int         # TensorCores the accelerator-type number counts per chip
    aot_name: str               # the topology_name prefix jax.experimental.topologies takes


# Cloud TPU documentation (system architecture pages), per chip.
CHIPS = {
    "v4": TpuChip("v4", 32 * GIB, 275e12, 2, "v4"),
    "v5e": TpuChip("v5e", 16 * GIB, 197e12, 1, "v5e"),
    "v5p": TpuChip("v5p", 95 * GIB, 459e12, 2, "v5p"),
    "v6e": TpuChip("v6e", 32 * GIB, 918e12, 1, "v6e"),
}
ALIASES = {"v5litepod": "v5e"}


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str          # as given, e.g. "v5p-16"
    chip: TpuChip
    chips: int

    @property
    def hbm_bytes(self) -> int:
        return self.chips * self.chip.hbm_bytes


def parse_topology(name: str) -> Topology:
    """``v5p-16`` -> 8 v5p chips. Raises MeshError naming the accepted forms."""
    m = re.fullmatch(r"(v4|v5e|v5litepod|v5p|v6e)-(\d+)", name.strip().lower())
    if not m:
        raise MeshError(f"unknown TPU topology {name!r}: use a Cloud TPU accelerator type such as "
                        "v4-32, v5p-16, v5litepod-8 (or v5e-8), v6e-4")
    chip = CHIPS[ALIASES.get(m.group(1), m.group(1))]
    count = int(m.group(2))
    if count < chip.cores_per_chip or count % chip.cores_per_chip:
        raise MeshError(f"TPU topology {name!r}: {chip.generation} counts "
                        f"{chip.cores_per_chip} TensorCores per chip; use a multiple of it")
    return Topology(name, chip, count // chip.cores_per_chip)


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """A mesh for ``topology`` and the HBM one chip needs under it (bytes)."""

    topology: Topology
    mode: str                      # "train" or "decode"
    mesh: MeshConfig
    bytes_per_chip: dict           # what / bytes, summed in ``total``

    @property
    def total(self) -> int:
        return int(sum(self.bytes_per_chip.values()))

    @property
    def fits(self) -> bool:
        return self.total <= self.topology.chip.hbm_bytes

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in self.bytes_per_chip.items())
        m = self.mesh
        t = self.topology
        return (f"{self.mode} on {t.name} ({t.chips} {t.chip.generation} "
                f"chips): mesh data={m.data} fsdp={m.fsdp} tensor={m.tensor}; per chip {parts} = "
                f"{self.total / GIB:.1f} GiB of {self.topology.chip.hbm_bytes / GIB:.0f} GiB: "
                f"{'fits' if self.fits else 'does NOT fit'}")


def _dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def kv_bytes_per_token(cfg: TargetConfig, dtype_bytes: int = 2) -> int:
    """Keys and values of one token in every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def draft_params(cfg: TargetConfig, draft_vocab_size: int) -> int:
    """Parameters of the EAGLE-3 head for ``cfg`` (its param specs; the embedding is the
    target's)."""
    import math

    from eagle3_jax.draft.config import DraftConfig
    from eagle3_jax.draft.params import draft_param_specs
    from eagle3_jax.model.params import is_spec
    import jax

    specs = draft_param_specs(DraftConfig.for_target(
        cfg, draft_vocab_size=min(draft_vocab_size, cfg.vocab_size)))
    return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec))


def _layer_matmul_params(cfg: TargetConfig) -> int:
    """Weights one target layer multiplies a token by (q, k, v, o and the MLP: a mixture of
    experts' router and the token's routed experts only)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    mlp = 3 * d * cfg.intermediate_size
    if cfg.is_moe:
        mlp = cfg.experts_per_token * mlp + cfg.num_experts * d
    return 2 * d * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + mlp


def train_step_flops(cfg: TargetConfig, *, tokens: int, max_len: int, ttt_steps: int,
                     draft_vocab_size: int) -> float:
    """Matmul FLOPs of one online training step over ``tokens`` tokens in rows of ``max_len``:
    the frozen target's forward (its output head included: the TTT targets are its
    distributions) and the head's forward and backward (3x) at every TTT step, causal attention
    at half the row on average."""
    d, hd = cfg.hidden_size, cfg.head_dim
    layer = _layer_matmul_params(cfg)
    attn = 2 * 2 * cfg.num_heads * hd * (max_len / 2)          # scores and values, per token
    target = tokens * (2 * (cfg.num_layers * layer + d * cfg.vocab_size) + cfg.num_layers * attn)
    head = 2 * (draft_params(cfg, draft_vocab_size) - 3 * d * d) + attn * (ttt_steps + 1) / 2
    return target + tokens * (2 * 3 * d * d + ttt_steps * 3 * head)


def verify_flops(cfg: TargetConfig, *, sequences: int, new_tokens: int, max_len: int) -> float:
    """Matmul FLOPs of the target's forward of ``new_tokens`` per sequence over a full cache of
    ``max_len`` slots (a draft tree's verification)."""
    per_token = 2 * (cfg.num_layers * _layer_matmul_params(cfg)
                     + cfg.hidden_size * cfg.vocab_size) \
        + cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * max_len
    return float(sequences * new_tokens * per_token)


def mesh_plan(cfg: TargetConfig, topology: str | Topology, mode: str, *, batch_size: int = 8,
              max_len: int = 2048, ttt_steps: int = 7, draft_vocab_size: int = 32000,
              cache_headroom: float = 0.8) -> MeshPlan:
    """The mesh and per-chip HBM for ``mode`` "train" (batch_size sequences of max_len per
    step) or "decode" (batch_size sequences, each with a KV cache of max_len tokens)."""
    topo = parse_topology(topology) if isinstance(topology, str) else topology
    chips, hbm = topo.chips, topo.chip.hbm_bytes
    weights = cfg.num_params * _dtype_bytes(cfg.dtype)
    if mode == "decode":
        kv = batch_size * max_len * kv_bytes_per_token(cfg, _dtype_bytes(cfg.dtype))
        tensor = 1
        while tensor < chips and (weights / tensor > cache_headroom * hbm
                                  or weights / tensor + kv / tensor > hbm):
            tensor *= 2
        tensor = min(tensor, chips)
        if chips % tensor:
            tensor = chips
        data = chips // tensor
        kv_shard = min(tensor, cfg.num_kv_heads) * max(data, 1)
        used = {"weights": weights / tensor, "kv cache": kv / kv_shard}
        return MeshPlan(topo, mode, MeshConfig(data=data, fsdp=1, tensor=tensor), used)
    if mode != "train":
        raise ValueError(f"mode must be 'train' or 'decode', got {mode!r}")
    head = draft_params(cfg, draft_vocab_size)
    tokens_per_chip = batch_size * max_len / chips
    d = cfg.hidden_size
    # Per token: the three taps and the TTT steps' states kept for the backward (float32), and
    # one target layer's transient activations (the frozen target keeps nothing).
    act = tokens_per_chip * (4 * (3 * d + ttt_steps * (8 * d + cfg.intermediate_size))
                             + _dtype_bytes(cfg.dtype) * (6 * d + 3 * cfg.intermediate_size))
    used = {"target": weights / chips, "head + grads + adam": 16 * head / chips,
            "activations": act}
    return MeshPlan(topo, mode, MeshConfig(data=1, fsdp=chips, tensor=1), used)
