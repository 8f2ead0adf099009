"""The target's parameter pytree: shapes and logical axis names, declared once.

``param_specs(cfg)`` is the single table used to create random parameters, to check and place
loaded checkpoints, and to derive shardings (``eagle3_jax.sharding``). Per-layer weights are
stacked on a leading ``layers`` axis so the forward can ``lax.scan`` over them (training).
``to_serving`` turns them into the serving layout (below): a tuple of L per-layer dicts with
fused projections, which the forward loops over, reading each weight in place; ``to_stacked``
is its inverse.

Layout (D hidden, N query heads, K kv heads, H head_dim, F mlp width, V vocab, L layers)::

    embed            [V, D]        ("vocab", "embed")
    layers/attn_norm [L, D]        ("layers", "norm")
    layers/wq        [L, D, N, H]  ("layers", "embed", "q_heads", "head_dim")
    layers/wk, wv    [L, D, K, H]  ("layers", "embed", "kv_heads", "head_dim")
    layers/wo        [L, N, H, D]  ("layers", "q_heads", "head_dim", "embed")
    layers/bq        [L, N, H]     Qwen2 only;  layers/bk, bv [L, K, H]
    layers/q_norm    [L, H]        Qwen3 and Gemma 3;  layers/k_norm [L, H]
    layers/mlp_norm  [L, D]
    layers/post_attn_norm, post_mlp_norm [L, D]   Gemma 3 (``sandwich_norms``)
    layers/w_gate    [L, D, F]     ("layers", "embed", "mlp");  layers/w_up likewise
    layers/w_down    [L, F, D]     ("layers", "mlp", "embed")
  mixture of experts (E experts of width F) in place of w_gate / w_up / w_down:
    layers/router       [L, E, D]     ("layers", "router", "embed")
    layers/expert_gate  [L, E, D, F]  ("layers", "experts", "embed", "mlp");  expert_up likewise
    layers/expert_down  [L, E, F, D]  ("layers", "experts", "mlp", "embed")
    final_norm       [D]           ("norm",)
    lm_head          [D, V]        ("embed", "vocab"), absent when embeddings are tied
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.kernels.matmul import PANEL
from eagle3_jax.kernels.matmul import from_panels as from_weight_panels
from eagle3_jax.kernels.matmul import to_panels as to_weight_panels
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.random_init import normal_values

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """Shape, logical axis names and initialiser kind (``"normal"``, ``"ones"``, ``"zeros"``)."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str = "normal"


def param_specs(cfg: TargetConfig) -> Params:
    """Nested dict of :class:`ParamSpec`, the same tree structure as the params."""
    d, f, n, k, h, v, nl = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                            cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.num_layers)
    layers = {
        "attn_norm": ParamSpec((nl, d), ("layers", "norm"), "ones"),
        "wq": ParamSpec((nl, d, n, h), ("layers", "embed", "q_heads", "head_dim")),
        "wk": ParamSpec((nl, d, k, h), ("layers", "embed", "kv_heads", "head_dim")),
        "wv": ParamSpec((nl, d, k, h), ("layers", "embed", "kv_heads", "head_dim")),
        "wo": ParamSpec((nl, n, h, d), ("layers", "q_heads", "head_dim", "embed")),
        "mlp_norm": ParamSpec((nl, d), ("layers", "norm"), "ones"),
        **_mlp_specs(cfg, (nl,), ("layers",)),
    }
    if cfg.sandwich_norms:
        layers["post_attn_norm"] = ParamSpec((nl, d), ("layers", "norm"), "ones")
        layers["post_mlp_norm"] = ParamSpec((nl, d), ("layers", "norm"), "ones")
    if cfg.attention_bias:
        layers["bq"] = ParamSpec((nl, n, h), ("layers", "q_heads", "head_dim"), "zeros")
        layers["bk"] = ParamSpec((nl, k, h), ("layers", "kv_heads", "head_dim"), "zeros")
        layers["bv"] = ParamSpec((nl, k, h), ("layers", "kv_heads", "head_dim"), "zeros")
    if cfg.qk_norm:
        layers["q_norm"] = ParamSpec((nl, h), ("layers", "head_dim"), "ones")
        layers["k_norm"] = ParamSpec((nl, h), ("layers", "head_dim"), "ones")
    specs: Params = {
        "embed": ParamSpec((v, d), ("vocab", "embed")),
        "layers": layers,
        "final_norm": ParamSpec((d,), ("norm",), "ones"),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((d, v), ("embed", "vocab"))
    return specs


def _mlp_specs(cfg: TargetConfig, lead: tuple[int, ...], lead_axes: tuple[str, ...]) -> Params:
    """The MLP's weights with ``lead`` dims in front: dense SwiGLU/GeGLU, or the router and
    experts of a mixture of experts (the same in the stacked and serving layouts)."""
    d, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    if not cfg.is_moe:
        return {"w_gate": ParamSpec(lead + (d, f), lead_axes + ("embed", "mlp")),
                "w_up": ParamSpec(lead + (d, f), lead_axes + ("embed", "mlp")),
                "w_down": ParamSpec(lead + (f, d), lead_axes + ("mlp", "embed"))}
    return {"router": ParamSpec(lead + (e, d), lead_axes + ("router", "embed")),
            "expert_gate": ParamSpec(lead + (e, d, f), lead_axes + ("experts", "embed", "mlp")),
            "expert_up": ParamSpec(lead + (e, d, f), lead_axes + ("experts", "embed", "mlp")),
            "expert_down": ParamSpec(lead + (e, f, d), lead_axes + ("experts", "mlp", "embed"))}


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def init_params(cfg: TargetConfig, key: jax.Array, scale: float = 0.02) -> Params:
    """Random parameters (normal(0, scale) matrices, unit norms, small random biases).

    Biases and norm scales get a random perturbation too, so tests exercise them.
    Wrap in ``jax.jit(..., out_shardings=...)`` to create them already sharded.
    """
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    dtype = jnp.dtype(cfg.dtype)
    out = []
    for spec, k in zip(leaves, keys):
        if spec.init == "normal":
            value = normal_values(k, spec.shape, scale, dtype=dtype)
        elif spec.init == "ones":
            value = normal_values(k, spec.shape, 0.1, offset=1.0, dtype=dtype)
        else:
            value = normal_values(k, spec.shape, 0.1, dtype=dtype)
        out.append(value)
    return jax.tree.unflatten(treedef, out)


def param_bytes(params: Params) -> int:
    """Total bytes of all parameter arrays."""
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)))


# ---------------------------------------------------------------------------------------------
# Serving layout. Checkpoints, training and sharding use the stacked table above. Decoding uses
# one dict per layer with the projections fused and stored [out, in] (contracting the last,
# contiguous axis), which is what XLA CPU's matrix-vector products read fastest; a stacked layer
# sliced out of ``[L, ...]`` inside the forward is a full copy of its weights on XLA CPU.
#
#   wqkv      [K, G+2, H, D]  ("kv_heads", "qkv", "head_dim", "embed"): the G query heads of
#                              kv group k (query head k*G + g), then key head k, then value head k
#   bqkv      [K, G+2, H]     Qwen2 only
#   wo        [D, N, H]       ("embed", "q_heads", "head_dim")
#   w_gate_up [2, F, D]       ("gate_up", "mlp", "embed")
#   w_down    [D, F]          ("embed", "mlp")
#   attn_norm, mlp_norm [D]; q_norm, k_norm [H] (Qwen3), post_attn_norm, post_mlp_norm [D]
#   (Gemma 3) and a mixture of experts' router, expert_gate, expert_up, expert_down as in the
#   stacked table, one layer of it.
#
# Panels (``to_panels``; what ``load_target`` gives for float32 decoding on one CPU device where
# the CPU matmul kernel runs): each of those four matrices, seen as [out, in], becomes
# ``<name>_panels`` [out/16, in, 16] (``eagle3_jax.kernels.matmul.to_panels``), and so does the
# output head: a tied ``embed`` is held as its panels [V/16, D, 16] (lookups read them with
# ``weight_rows``), an untied ``lm_head`` [D, V] becomes ``lm_head_panels`` [V/16, D, 16]. The
# forward reads either form; a matrix whose `out` is not a multiple of 16 stays as it is.
# ---------------------------------------------------------------------------------------------


def serving_layer_specs(cfg: TargetConfig) -> dict[str, ParamSpec]:
    """Shapes and logical axes of one layer in the serving layout (see the table above)."""
    d, f, n, k, h = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                     cfg.head_dim)
    g = n // k
    specs = {
        "attn_norm": ParamSpec((d,), ("norm",), "ones"),
        "wqkv": ParamSpec((k, g + 2, h, d), ("kv_heads", "qkv", "head_dim", "embed")),
        "wo": ParamSpec((d, n, h), ("embed", "q_heads", "head_dim")),
        "mlp_norm": ParamSpec((d,), ("norm",), "ones"),
    }
    if cfg.is_moe:
        specs.update(_mlp_specs(cfg, (), ()))
    else:
        specs["w_gate_up"] = ParamSpec((2, f, d), ("gate_up", "mlp", "embed"))
        specs["w_down"] = ParamSpec((d, f), ("embed", "mlp"))
    if cfg.sandwich_norms:
        specs["post_attn_norm"] = ParamSpec((d,), ("norm",), "ones")
        specs["post_mlp_norm"] = ParamSpec((d,), ("norm",), "ones")
    if cfg.attention_bias:
        specs["bqkv"] = ParamSpec((k, g + 2, h), ("kv_heads", "qkv", "head_dim"), "zeros")
    if cfg.qk_norm:
        specs["q_norm"] = ParamSpec((h,), ("head_dim",), "ones")
        specs["k_norm"] = ParamSpec((h,), ("head_dim",), "ones")
    return specs


def serving_specs(cfg: TargetConfig) -> Params:
    """The whole serving tree: ``param_specs`` with ``layers`` as L per-layer dicts."""
    specs = param_specs(cfg)
    return {**specs, "layers": tuple(serving_layer_specs(cfg) for _ in range(cfg.num_layers))}


def to_serving_layer(p: Params, cfg: TargetConfig) -> Params:
    """One layer, stacked-table layout -> serving layout (traceable; exact, only moves data).

    Works on any subset of one layer's weights that holds whole groups (q/k/v, gate/up, ...)
    and returns the serving entries of those groups, so ``to_serving`` can convert and release
    one group at a time.
    """
    d, k = cfg.hidden_size, cfg.num_kv_heads
    g = cfg.num_heads // k
    out = {name: p[name] for name in _AS_THEY_ARE if name in p}
    if "wq" in p:
        q = p["wq"].reshape(d, k, g, -1).transpose(1, 2, 3, 0)  # [K, G, H, D]
        out["wqkv"] = jnp.concatenate([q, p["wk"].transpose(1, 2, 0)[:, None],
                                       p["wv"].transpose(1, 2, 0)[:, None]], axis=1)
    if "bq" in p:
        out["bqkv"] = jnp.concatenate([p["bq"].reshape(k, g, -1), p["bk"][:, None],
                                       p["bv"][:, None]], axis=1)
    if "wo" in p:
        out["wo"] = p["wo"].transpose(2, 0, 1)
    if "w_gate" in p:
        out["w_gate_up"] = jnp.stack([p["w_gate"].T, p["w_up"].T])
    if "w_down" in p:
        out["w_down"] = p["w_down"].T
    return out


# Stacked weights converted together (each group becomes whole serving entries).
_AS_THEY_ARE = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm",
                "router", "expert_gate", "expert_up", "expert_down")
_SERVING_GROUPS = (("wq", "wk", "wv"), ("bq", "bk", "bv"), ("w_gate", "w_up"), ("wo",),
                   ("w_down",)) + tuple((name,) for name in _AS_THEY_ARE)


def from_serving_layer(p: Params, cfg: TargetConfig) -> Params:
    """Inverse of :func:`to_serving_layer`."""
    d, n, k = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
    g = n // k
    wqkv = p["wqkv"]
    out = {
        "wq": wqkv[:, :g].transpose(3, 0, 1, 2).reshape(d, n, -1),
        "wk": wqkv[:, g].transpose(2, 0, 1), "wv": wqkv[:, g + 1].transpose(2, 0, 1),
        "wo": p["wo"].transpose(1, 2, 0),
    }
    if "w_gate_up" in p:
        out.update(w_gate=p["w_gate_up"][0].T, w_up=p["w_gate_up"][1].T, w_down=p["w_down"].T)
    if "bqkv" in p:
        out["bq"] = p["bqkv"][:, :g].reshape(n, -1)
        out["bk"], out["bv"] = p["bqkv"][:, g], p["bqkv"][:, g + 1]
    out.update({name: p[name] for name in _AS_THEY_ARE if name in p})
    return out


def is_serving(params: Params) -> bool:
    """True when ``params["layers"]`` is a tuple of per-layer dicts (serving layout)."""
    return not isinstance(params["layers"], dict)


def to_serving(params: Params, cfg: TargetConfig, *, shardings: Any = None,
               delete_stacked: bool = False) -> Params:
    """Stacked params -> serving params (``layers``: tuple of L per-layer dicts, fused).

    Args:
      shardings: optional tree of NamedSharding for ``serving_specs(cfg)`` (place each layer
        as the serving rules say); None lets XLA propagate the input placement.
      delete_stacked: delete each group of stacked weights (q/k/v, gate/up, ...) once it is
        converted; the caller must not use ``params`` afterwards. Peak extra memory is then the
        largest group (gate + up), not a second copy of the model.
    Serving params are returned unchanged.
    """
    if is_serving(params):
        return params
    stacked = params["layers"]
    per_layer = [{} for _ in range(cfg.num_layers)]
    for group in _SERVING_GROUPS:
        group = {name: stacked[name] for name in group if name in stacked}
        if not group:
            continue
        names = jax.eval_shape(lambda part: to_serving_layer(
            jax.tree.map(lambda a: a[0], part), cfg), group).keys()
        out_shardings = None
        if shardings is not None:
            out_shardings = {name: shardings["layers"][0][name] for name in names}
        convert = jax.jit(lambda part, i: to_serving_layer(jax.tree.map(lambda a: a[i], part),
                                                           cfg), out_shardings=out_shardings)
        for i, layer in enumerate(per_layer):
            layer.update(convert(group, i))
        if delete_stacked:
            jax.block_until_ready(per_layer)
            for a in group.values():
                a.delete()
    return {**params, "layers": tuple(per_layer)}


# Serving matrices as [out, in] (the shapes ``_layer`` multiplies by), by entry name.
def _serving_matrices(cfg: TargetConfig) -> dict[str, tuple[int, int]]:
    d, f = cfg.hidden_size, cfg.intermediate_size
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    mlp = {} if cfg.is_moe else {"w_gate_up": (2 * f, d), "w_down": (d, f)}
    return {"wqkv": ((n + 2 * k) * h, d), "wo": (d, n * h), **mlp}


def has_panels(params: Params) -> bool:
    """Whether serving ``params`` hold their matrices as panels (:func:`to_panels`)."""
    return params["embed"].ndim == 3 or "lm_head_panels" in params or any(
        name.endswith("_panels") for name in params["layers"][0])


def to_panels(params: Params, cfg: TargetConfig, *, delete_rows: bool = False) -> Params:
    """Serving params -> the same with every matrix as panels (the table above; exact, only
    moves data). For float32 decoding on one CPU device, where the CPU matmul kernel streams
    panels fastest (``eagle3_jax.kernels.matmul.panel_matmul``). Params with panels already,
    and stacked params, are returned unchanged.

    ``delete_rows``: delete each matrix once its panels are made (the caller must not use
    ``params`` afterwards): peak extra memory is one layer's matrices or the output head.
    """
    if not is_serving(params) or has_panels(params):
        return params
    shapes = {name: shape for name, shape in _serving_matrices(cfg).items()
              if shape[0] % PANEL == 0}
    layer_fn = jax.jit(lambda p: {name + "_panels": to_weight_panels(p[name].reshape(shape))
                                  for name, shape in shapes.items()})

    def release(made, *arrays):  # delete ``arrays`` once ``made`` from them is computed
        if delete_rows:
            jax.block_until_ready(made)
            for a in arrays:
                a.delete()

    layers = []
    for p in params["layers"]:
        matrices = {name: p[name] for name in shapes}
        out_parts = layer_fn(matrices)
        layers.append({**{n: a for n, a in p.items() if n not in shapes}, **out_parts})
        release(out_parts, *matrices.values())
    out = {**params, "layers": tuple(layers)}
    if cfg.tie_word_embeddings and params["embed"].shape[0] % PANEL == 0:
        out["embed"] = jax.jit(to_weight_panels)(params["embed"])
        release(out["embed"], params["embed"])
    elif not cfg.tie_word_embeddings and params["lm_head"].shape[1] % PANEL == 0:
        del out["lm_head"]
        out["lm_head_panels"] = jax.jit(lambda w: to_weight_panels(w.T))(params["lm_head"])
        release(out["lm_head_panels"], params["lm_head"])
    return out


def from_panels(params: Params, cfg: TargetConfig) -> Params:
    """Inverse of :func:`to_panels` (params without panels are returned unchanged)."""
    if not is_serving(params) or not has_panels(params):
        return params
    specs = serving_layer_specs(cfg)
    layers = []
    for p in params["layers"]:
        layer = {name: a for name, a in p.items() if not name.endswith("_panels")}
        for name in _serving_matrices(cfg):
            if name + "_panels" in p:
                layer[name] = from_weight_panels(p[name + "_panels"]).reshape(specs[name].shape)
        layers.append(layer)
    out = {**params, "layers": tuple(layers)}
    if params["embed"].ndim == 3:
        out["embed"] = from_weight_panels(params["embed"])
    if "lm_head_panels" in params:
        del out["lm_head_panels"]
        out["lm_head"] = from_weight_panels(params["lm_head_panels"]).T
    return out


def to_stacked(params: Params, cfg: TargetConfig) -> Params:
    """Inverse of :func:`to_serving` (stacked params are returned unchanged)."""
    if not is_serving(params):
        return params
    params = from_panels(params, cfg)
    layers = [from_serving_layer(p, cfg) for p in params["layers"]]
    return {**params, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}
