"""Device mesh and logical-axis sharding rules."""

from eagle3_jax.sharding.mesh import (
    KV_CACHE_K_AXES, KV_CACHE_V_AXES, MESH_AXES, RULES, SERVING_RULES, TRAINING_RULES, MeshConfig,
    MeshError, describe_fallbacks, logical_to_pspec, make_mesh, named_sharding, param_shardings,
    replicated_like, shard_array,
)

__all__ = [
    "KV_CACHE_K_AXES", "KV_CACHE_V_AXES", "MESH_AXES", "RULES", "SERVING_RULES", "TRAINING_RULES",
    "MeshConfig", "MeshError", "describe_fallbacks", "logical_to_pspec", "make_mesh",
    "named_sharding", "param_shardings", "replicated_like", "shard_array",
]
