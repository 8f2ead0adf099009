"""Device mesh from config, and logical-axis -> mesh-axis rules for training and serving.

Model code names every array axis logically ("embed", "q_heads", "mlp", ...); one rules table
per mode maps those names to the mesh axes ("data", "fsdp", "tensor"). A dimension whose size
does not divide the mesh axes it maps to (SmolLM2's 9 query / 3 kv heads on tensor=8) is
replicated instead, and ``describe_fallbacks`` says which ones were.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from eagle3_jax.errors import Eagle3Error
from eagle3_jax.model.params import ParamSpec, is_spec
from eagle3_jax.sharding.activations import BATCH_AXES, EXPERT_AXIS

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. Training shards parameters over fsdp (ZeRO-3 style) and tensor;
# serving keeps full rows per device (no fsdp gather per token) and shards over tensor only.
# A mixture of experts' weights [E, ...] are split by whole experts over tensor (expert
# parallelism: "experts" comes first in their axes, so their "mlp" axis is then left whole);
# the MoE layer runs each device's experts on its tokens and sums over tensor
# (``eagle3_jax.model.moe``).
TRAINING_RULES: Mapping[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "experts": (EXPERT_AXIS,),
    "mlp": ("tensor",),
}
SERVING_RULES: Mapping[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    "vocab": ("tensor",),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "experts": (EXPERT_AXIS,),
    "mlp": ("tensor",),
}
RULES = {"training": TRAINING_RULES, "serving": SERVING_RULES}

# Axes of one layer's KV cache (``KVCache.k`` / ``.v`` hold one per layer): keys [B, K, H, S],
# values [B, K, S, H].
KV_CACHE_K_AXES = ("batch", "kv_heads", "head_dim", "cache_seq")
KV_CACHE_V_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")


class MeshError(Eagle3Error, ValueError):
    """A mesh that cannot be built on the devices present; the message says what fits."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the (data, fsdp, tensor) mesh axes; one axis may be -1 = all remaining devices."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.tensor)
        if sum(s == -1 for s in sizes) > 1:
            raise MeshError(f"at most one mesh axis may be -1 (fill), got {sizes}")
        if any(s == 0 or s < -1 for s in sizes):
            raise MeshError(f"mesh axis sizes must be positive or -1, got {sizes}")

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        sizes = [self.data, self.fsdp, self.tensor]
        fixed = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % fixed:
                raise MeshError(
                    f"mesh {dict(zip(MESH_AXES, sizes))} cannot fill {num_devices} devices: "
                    f"{num_devices} is not a multiple of {fixed}"
                )
            sizes[sizes.index(-1)] = num_devices // fixed
        elif fixed != num_devices:
            raise MeshError(
                f"mesh {dict(zip(MESH_AXES, sizes))} needs {fixed} devices but {num_devices} "
                "are present; set one axis to -1 to fill the devices"
            )
        return tuple(sizes)  # type: ignore[return-value]


def make_mesh(cfg: MeshConfig = MeshConfig(), devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axes (GSPMD propagates activation shardings)."""
    devices = list(devices) if devices is not None else jax.devices()
    shape = cfg.resolve(len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def logical_to_pspec(
    axes: Sequence[str], shape: Sequence[int], mesh: Mesh, rules: Mapping[str, tuple[str, ...]]
) -> PartitionSpec:
    """PartitionSpec for an array with logical ``axes``; indivisible dimensions are replicated."""
    used: set[str] = set()
    spec = []
    for name, size in zip(axes, shape):
        mesh_axes = tuple(a for a in rules.get(name, ()) if mesh.shape[a] > 1 and a not in used)
        product = math.prod(mesh.shape[a] for a in mesh_axes)
        if mesh_axes and size % product:
            log.info("axis %r (size %d) does not divide mesh axes %s (%d): replicated",
                     name, size, mesh_axes, product)
            mesh_axes = ()
        used.update(mesh_axes)
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def named_sharding(axes, shape, mesh: Mesh, mode: str = "serving") -> NamedSharding:
    return NamedSharding(mesh, logical_to_pspec(axes, shape, mesh, RULES[mode]))


def param_shardings(specs: Any, mesh: Mesh, mode: str = "serving") -> Any:
    """Tree of NamedSharding matching a tree of :class:`ParamSpec`."""
    return jax.tree.map(lambda s: named_sharding(s.axes, s.shape, mesh, mode), specs,
                        is_leaf=is_spec)


def describe_fallbacks(specs: Any, mesh: Mesh, mode: str = "serving") -> list[str]:
    """Human-readable list of logical axes that had to be replicated on this mesh."""
    rules = RULES[mode]
    notes = set()
    for s in jax.tree.leaves(specs, is_leaf=is_spec):
        for name, size in zip(s.axes, s.shape):
            mesh_axes = [a for a in rules.get(name, ()) if mesh.shape[a] > 1]
            product = math.prod(mesh.shape[a] for a in mesh_axes)
            if mesh_axes and size % product:
                notes.add(f"{name} ({size}) does not divide {'x'.join(mesh_axes)}={product}: "
                          "replicated")
    return sorted(notes)


def replicated_like(tree: Any, reference: Any) -> Any:
    """``tree`` (arrays) replicated over the mesh that ``reference``'s arrays lie on, or unchanged
    where none lies on a mesh. A jitted call keys its compiled program on its arguments'
    shardings, and its results lie on the weights' mesh: an array made on the host (a fresh KV
    cache) and then the same array as a call returned it would compile the call twice."""
    on_mesh = (x.sharding for x in jax.tree.leaves(reference)
               if isinstance(getattr(x, "sharding", None), NamedSharding))
    sharding = next(on_mesh, None)
    if sharding is None:
        return tree
    return jax.device_put(tree, NamedSharding(sharding.mesh, PartitionSpec()))


def shard_array(array: np.ndarray, spec: ParamSpec, sharding: NamedSharding) -> jax.Array:
    """Place one host array on the mesh, each device receiving only its own slice."""
    if tuple(array.shape) != tuple(spec.shape):
        raise ValueError(f"shape {tuple(array.shape)} does not match expected {spec.shape}")
    return jax.make_array_from_callback(spec.shape, sharding, lambda index: array[index])
