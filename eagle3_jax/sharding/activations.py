"""Activation sharding: keep the batch split over the mesh inside a jitted step.

Parameters are placed by the logical-axis rules (``eagle3_jax.sharding.mesh``); activations are
left to XLA's sharding propagation, which follows the weights. Under FSDP the weights are split
over ``fsdp`` along their feature axes, so without a hint XLA splits activations along those
axes too and gathers the batch: every chip then computes the whole global batch (the target's
forward, the labels, the draft's logits) on 1/n of the features. :func:`shard_batch` pins an
activation's batch axis to the data x fsdp axes (the other axes left to XLA), so each chip runs
its own sequences and gathers the weights instead, as FSDP means.

It acts only while a mesh is set (``jax.set_mesh``: training and the TPU plans lower their steps
under one); elsewhere (decoding, tests without a mesh) it returns its input unchanged.
This module imports nothing of the package, so model code can use it.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec

# The mesh axes a batch is split over (data parallel x fully sharded data parallel).
BATCH_AXES = ("data", "fsdp")
# The mesh axis a mixture of experts' experts are split over (expert parallelism; the rules
# tables of ``eagle3_jax.sharding.mesh`` map the "experts" axis to it).
EXPERT_AXIS = "tensor"


def _batch_axes() -> tuple[tuple[str, ...], int]:
    """The set mesh's batch axes larger than one and their product ((), 1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return (), 1
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    return axes, math.prod(mesh.shape[a] for a in axes)


def shard_batch(x: jax.Array, axis: int = 0) -> jax.Array:
    """``x`` with its ``axis`` (the batch, or batch x sequence flattened) constrained to be split
    over the set mesh's data x fsdp axes, its other axes left to XLA; unchanged without a mesh,
    without a batch axis larger than one, or when ``axis`` does not divide (one sequence on
    many chips)."""
    axes, shards = _batch_axes()
    if not axes or x.shape[axis] % shards:
        return x
    spec = [PartitionSpec.UNCONSTRAINED] * x.ndim
    spec[axis] = axes
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def expert_mesh() -> tuple[jax.sharding.AbstractMesh | None, str | None]:
    """(the set mesh, ``EXPERT_AXIS``) when a mesh is set whose expert axis is larger than one,
    else (None, None): where an MoE layer splits its experts over devices."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names or mesh.shape[EXPERT_AXIS] == 1:
        return None, None
    return mesh, EXPERT_AXIS
