"""The draft head's parameter tree: shapes and logical axes, declared once.

Layout (D hidden, N/K heads, H head_dim, F mlp, Vd draft vocab)::

    fc          [3D, D]     fused low/mid/high target features -> D
    fc_norm     [3, D]      EAGLE-3.1 only (cfg.fc_norm): one RMSNorm scale per tap, before fc
    attn_norm   [D]         input_layernorm (on the token embedding)
    hidden_norm [D]         on the feature
    wq          [2D, N, H]  q/k/v read concat(embedding, feature)
    wk, wv      [2D, K, H]
    wo          [N, H, D]
    mlp_norm    [D]         post_attention_layernorm
    w_gate/w_up [D, F];  w_down [F, D]
    final_norm  [D]
    lm_head     [D, Vd]

The vocabulary maps ``d2t`` [Vd] (int32 offsets) and ``t2d`` [V] (bool) are not trained and live
beside the params in :class:`DraftHead`.

Decoding reads the matrices in the serving layout (:func:`to_serving`, ``DraftHead.serving``):
each transposed to [out, in] (suffix ``_t``), q/k/v and gate/up fused, the norms as they are::

    fc_t        [D, 3D]
    wqkv_t      [(N + 2K) H, 2D]   rows: q heads, then k, then v
    wo_t        [D, N H]
    w_gate_up_t [2F, D]            rows: gate, then up
    w_down_t    [D, F]
    lm_head_t   [Vd, D]

That is the form the CPU rows kernel reads at memory speed for the few rows of a draft step
(``kernels/matmul.py``): on a 2-core AVX2 CPU one step's matmuls take 1.2 ms at 2 rows and 1.24
at 4, against 2.3 and 3.3 as XLA dots of the [in, out] matrices. ``DraftHead.serving`` holds
them as bfloat16 where every value is one and the kernel runs (a head stored in 16 bits): a
whole draft step then takes 0.76-0.84 ms at 1-4 rows against 1.27-1.40 (``bench forward``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.kernels.matmul import bfloat16_weights
from eagle3_jax.model.params import ParamSpec, Params, is_spec
from eagle3_jax.model.random_init import normal_values


def draft_param_specs(cfg: DraftConfig) -> Params:
    d, f, n, k, h = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                     cfg.head_dim)
    extra = {"fc_norm": ParamSpec((cfg.num_taps, d), ("taps", "norm"), "ones")} if cfg.fc_norm \
        else {}
    return {**extra,
        "fc": ParamSpec((cfg.num_taps * d, d), ("fused", "embed")),
        "attn_norm": ParamSpec((d,), ("norm",), "ones"),
        "hidden_norm": ParamSpec((d,), ("norm",), "ones"),
        "wq": ParamSpec((2 * d, n, h), ("embed", "q_heads", "head_dim")),
        "wk": ParamSpec((2 * d, k, h), ("embed", "kv_heads", "head_dim")),
        "wv": ParamSpec((2 * d, k, h), ("embed", "kv_heads", "head_dim")),
        "wo": ParamSpec((n, h, d), ("q_heads", "head_dim", "embed")),
        "mlp_norm": ParamSpec((d,), ("norm",), "ones"),
        "w_gate": ParamSpec((d, f), ("embed", "mlp")),
        "w_up": ParamSpec((d, f), ("embed", "mlp")),
        "w_down": ParamSpec((f, d), ("mlp", "embed")),
        "final_norm": ParamSpec((d,), ("norm",), "ones"),
        "lm_head": ParamSpec((d, cfg.draft_vocab_size), ("embed", "vocab")),
    }


def init_draft_params(cfg: DraftConfig, key: jax.Array, scale: float = 0.02) -> Params:
    """Random draft params (normal(0, scale) matrices, unit norm scales)."""
    specs = draft_param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    dtype = jnp.dtype(cfg.dtype)
    out = [
        jnp.ones(s.shape, jnp.float32).astype(dtype) if s.init == "ones"
        else normal_values(k, s.shape, scale, dtype=dtype)
        for s, k in zip(leaves, keys)
    ]
    return jax.tree.unflatten(treedef, out)


@struct.dataclass
class VocabMap:
    """Draft <-> target vocabulary maps (reference §3).

    d2t: [Vd] int32, ``target_id = draft_id + d2t[draft_id]``.
    t2d: [V] bool, True for target ids in the draft vocabulary.
    """

    d2t: jax.Array
    t2d: jax.Array

    @property
    def draft_to_target(self) -> jax.Array:
        """[Vd] int32 target id of every draft id."""
        return jnp.arange(self.d2t.shape[0], dtype=jnp.int32) + self.d2t

    @classmethod
    def identity(cls, vocab_size: int) -> "VocabMap":
        return cls(jnp.zeros((vocab_size,), jnp.int32), jnp.ones((vocab_size,), bool))

    @classmethod
    def from_used_ids(cls, used_ids: np.ndarray, vocab_size: int) -> "VocabMap":
        """From the sorted target ids kept in the draft vocabulary."""
        used = np.sort(np.asarray(used_ids, dtype=np.int64))
        if len(np.unique(used)) != len(used) or used.min() < 0 or used.max() >= vocab_size:
            raise ValueError("draft vocabulary ids must be unique and inside the target vocab")
        t2d = np.zeros((vocab_size,), bool)
        t2d[used] = True
        return cls(jnp.asarray(used - np.arange(len(used)), jnp.int32), jnp.asarray(t2d))


def is_serving(params: Params) -> bool:
    """Whether draft ``params`` are in the serving layout (module docstring)."""
    return "wqkv_t" in params


@jax.jit
def _serving_matrices(params: Params) -> Params:
    e = params["wq"].shape[0]
    return {
        "fc_t": params["fc"].T,
        "wqkv_t": jnp.concatenate([params[w].reshape(e, -1) for w in ("wq", "wk", "wv")], 1).T,
        "wo_t": params["wo"].reshape(-1, params["wo"].shape[-1]).T,
        "w_gate_up_t": jnp.concatenate([params["w_gate"], params["w_up"]], 1).T,
        "w_down_t": params["w_down"].T,
        "lm_head_t": params["lm_head"].T,
    }


SERVING_MATRICES = ("fc_t", "wqkv_t", "wo_t", "w_gate_up_t", "w_down_t", "lm_head_t")


def to_serving(params: Params) -> Params:
    """Draft params as trained -> the serving layout (module docstring); exact (only moves
    data), and serving params are returned unchanged."""
    if is_serving(params):
        return params
    matrices = ("fc", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")
    rest = {name: value for name, value in params.items() if name not in matrices}
    return {**rest, **_serving_matrices({name: params[name] for name in matrices})}


@struct.dataclass
class DraftHead:
    """Everything a trained head carries: config (static), params and vocabulary maps."""

    params: Params
    vocab: VocabMap
    cfg: DraftConfig = struct.field(pytree_node=False)

    def serving(self) -> "DraftHead":
        """This head with its params in the serving layout (:func:`to_serving`), what decoding
        runs; itself when they already are. On CPU with the matmul kernel, matrices whose
        values are all bfloat16 (a head stored in 16 bits and loaded as float32, like the
        shipped one) are held as bfloat16: a draft step, memory-bound on its weights, reads
        half the bytes and computes the same float32 products (``bfloat16_weights``)."""
        if is_serving(self.params):
            return self
        params = to_serving(self.params)
        return self.replace(params={name: bfloat16_weights(value) if name in SERVING_MATRICES
                                    else value for name, value in params.items()})
