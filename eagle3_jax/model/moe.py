"""Mixture-of-experts MLP that multiplies only the experts each token is routed to.

Used by the Qwen3-MoE (e.g. 128 experts, top-8, ``norm_topk_prob``) and Mixtral (8 experts,
top-2, always normalised) layers. One layer, for N tokens:

1. ``route``: float32 logits [N, E] = x @ router.T, softmax over E, top-k -> weights [N, k]
   (renormalised to sum 1 when ``normalize``) and experts [N, k] int32.
2. The N*k (token, choice) assignments are sorted by expert (stable, so token order is kept
   inside each expert), the token rows gathered in that order: xs [M = N*k, D], with
   group_sizes [E] = rows per expert.
3. ``grouped_matmul`` runs each expert's SwiGLU on its own rows only: gate, up [M, F], then down
   [M, D]. An expert no token picked is never read.
4. The rows go back to (token, choice) order, are scaled by their routing weight and the k
   choices of each token summed: out [N, D].

Weights per expert are ``[in, out]`` (x @ w): w_gate, w_up [E, D, F], w_down [E, F, D]; the
router keeps HF's ``[out, in]`` layout, [E, D] (``mlp.gate.weight``).

``grouped_matmul`` is XLA's ``ragged_dot`` on TPU. Elsewhere (CPU, GPU) XLA lowers ragged_dot
densely, every group for every row (G times the FLOPs, and a NaN in any expert reaches every
row), so there it is a loop over fixed-size row blocks, each multiplied by one group's weights.

Expert parallelism (``mesh``, ``expert_axis``): each device holds E/n whole experts, routes all
tokens, multiplies the rows routed to its own experts and a ``psum`` over the axis adds the
devices' parts.

Einsum letters: N tokens, D hidden, E experts, F expert mlp width, M sorted rows (N*k),
K contracted width, O output width, G groups.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from eagle3_jax.model.layers import ACTIVATIONS


def route(x: jax.Array, router: jax.Array, top_k: int, normalize: bool
          ) -> tuple[jax.Array, jax.Array]:
    """Top-k softmax routing, as HF's Qwen3MoeTopKRouter / MixtralTopKRouter.

    x [N, D] (any float dtype), router [E, D]. Returns (weights [N, k] float32,
    experts [N, k] int32), each row's experts in decreasing weight. With ``normalize`` the k
    weights are divided by their sum (Mixtral always; Qwen3-MoE when ``norm_topk_prob``).
    Exactly equal probabilities are the one place the choice can differ from HF:
    ``lax.top_k`` takes the lower expert index first, ``torch.topk`` promises no order (on CPU
    it picked [2, 4] of three equal entries at 1, 2, 4).

    The logits are float32 here for every input dtype (HF computes them in the hidden dtype and
    only the softmax in float32), and at full precision: the top-k choice is discontinuous in
    them, and TPUs' default float32 matmul rounds its inputs to bfloat16.
    """
    logits = jnp.einsum("ND,ED->NE", x.astype(jnp.float32), router.astype(jnp.float32),
                        preferred_element_type=jnp.float32,
                        precision=jax.lax.Precision.HIGHEST)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def block_rows(rows: int, groups: int) -> int:
    """Rows per block of the blocked grouped matmul: the power of two at or above the mean
    group size, clipped to [8, 128]. A block holds rows of one group only, so each non-empty
    group wastes less than one block: small blocks for decode (a few rows over many experts),
    128 (a full MXU/AMX tile) for prefill."""
    mean = -(-rows // max(groups, 1))
    return int(min(max(1 << max(mean - 1, 0).bit_length(), 8), 128))


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Rows of x times their group's weights: out[r] = x[r] @ w[g(r)].

    x [M, K] with rows sorted by group, w [G, K, O], group_sizes [G] int32 (sum <= M; the
    rows past the sum come out zero). Returns [M, O] in x and w's promoted dtype, accumulated
    in float32. On TPU this is ``lax.ragged_dot``; on other platforms the blocked loop of
    ``grouped_matmul_blocked``, which reads only the weights of groups that hold rows. The
    choice is made when the program is lowered, so a TPU program compiled on a CPU host still
    gets ragged_dot.
    """
    return jax.lax.platform_dependent(
        x, w, group_sizes, tpu=_grouped_matmul_ragged, default=grouped_matmul_blocked)


def _grouped_matmul_ragged(x, w, group_sizes):
    out = jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(jnp.result_type(x, w))


# Up to this many bytes of gathered weights (rows x K x O), ``grouped_matmul_blocked`` gathers
# each row's group weights and multiplies row by row instead of looping over blocks: a program
# with no loop, about half the compile time, as fast for a decode step's few rows (`bench
# forward --moe`, 64 experts of 512 x 256: 2.4 ms either way for 8 rows, 4 MiB), but slower
# once the copies grow (32 rows: 17 ms gathered, 6.9 ms looped).
GATHER_BYTES = 8 * 2**20


def grouped_matmul_blocked(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``grouped_matmul`` off TPU (shapes as there): for few rows (``GATHER_BYTES``)
    :func:`grouped_matmul_gathered`, else :func:`grouped_matmul_loop`."""
    rows, k = x.shape
    if rows * k * w.shape[2] * jnp.dtype(w.dtype).itemsize <= GATHER_BYTES:
        return grouped_matmul_gathered(x, w, group_sizes)
    return grouped_matmul_loop(x, w, group_sizes)


def grouped_matmul_loop(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``grouped_matmul`` as a loop over row blocks (shapes as there).

    Each group's rows are padded to a multiple of m = ``block_rows(M, G)``, so every block of m
    rows belongs to one group; there are at most nb = ceil(M/m) + min(G, M) blocks (each
    non-empty group adds less than one block of padding). A ``lax.scan`` over the blocks slices
    the block's m rows of x and its group's [K, O] weights and multiplies them; a block past
    the last group's rows skips the matmul (``lax.cond``), so the weights of groups without rows
    are never read. The products are gathered back to x's row order.
    """
    rows, k = x.shape
    groups, _, o = w.shape
    m = block_rows(rows, groups)
    nb = -(-rows // m) + min(groups, rows)
    out_dtype = jnp.result_type(x, w)

    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    row_end = jnp.cumsum(sizes)                         # [G] first row after each group
    row_start = row_end - sizes                         # [G]
    blocks = (sizes + m - 1) // m                       # [G] blocks per group
    block_end = jnp.cumsum(blocks)                      # [G]
    block_start = block_end - blocks                    # [G]

    # Block b's group: the first group whose blocks end after b (G when b is past them all).
    block_ids = jnp.arange(nb, dtype=jnp.int32)
    block_group = _count_at_or_below(block_end, block_ids)
    g = jnp.minimum(block_group, groups - 1)
    first_row = row_start[g] + (block_ids - block_start[g]) * m          # [nb]
    live = block_group < groups                                          # [nb]

    # m zero rows after x keep every block's slice inside it (dynamic_slice would clamp a start
    # past M - m and misalign the block's rows).
    x_padded = jnp.concatenate([x, jnp.zeros((m, k), x.dtype)])

    def block(_, step):
        group, start, is_live = step

        def multiply():
            xb = jax.lax.dynamic_slice_in_dim(x_padded, start, m)       # [m, K]
            wb = jax.lax.dynamic_index_in_dim(w, group, keepdims=False)  # [K, O]
            return jnp.einsum("MK,KO->MO", xb, wb, preferred_element_type=jnp.float32)

        def skip():
            # Inside shard_map the product varies over the mesh axes its operands vary over;
            # cond needs the zeros typed the same.
            zeros = jnp.zeros((m, o), jnp.float32)
            axes = set().union(*(jax.typeof(a).manual_axis_type.varying
                                 for a in (x_padded, w, group, start)))
            return jax.lax.pcast(zeros, tuple(sorted(axes)), to="varying")

        return None, jax.lax.cond(is_live, multiply, skip)

    _, ys = jax.lax.scan(block, None, (g, first_row, live))              # [nb, m, O]

    # Row r of group h sits in block block_start[h] + (r - row_start[h]) // m, at the same
    # offset mod m; rows past the last group have no block and come out zero.
    r = jnp.arange(rows, dtype=jnp.int32)
    h = jnp.minimum(_count_at_or_below(row_end, r), groups - 1)
    within = r - row_start[h]
    slot = (block_start[h] + within // m) * m + within % m
    out = ys.reshape(nb * m, o)[slot]
    return jnp.where((r < row_end[-1])[:, None], out, 0).astype(out_dtype)


def grouped_matmul_gathered(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``grouped_matmul`` for few rows (shapes as there): row r times w[its group] (rows past the groups' sum are
    zero), the group weights gathered: only groups that hold rows are read."""
    rows, groups = x.shape[0], w.shape[0]
    row_end = jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0))            # [G]
    r = jnp.arange(rows, dtype=jnp.int32)
    h = jnp.minimum(_count_at_or_below(row_end, r), groups - 1)                     # [M]
    out = jnp.einsum("MK,MKO->MO", x, w[h], preferred_element_type=jnp.float32)
    return jnp.where((r < row_end[-1])[:, None], out, 0).astype(jnp.result_type(x, w))


def _count_at_or_below(ends: jax.Array, queries: jax.Array) -> jax.Array:
    """For sorted ends [G] and queries [Q]: how many ends are <= each query, int32 [Q]
    (``searchsorted(side="right")``). A [Q, G] comparison: jnp.searchsorted fails to trace
    inside a shard_map that is manual over only some mesh axes (jax 0.10.2), and G is small."""
    return jnp.sum(ends[None, :] <= queries[:, None], axis=1, dtype=jnp.int32)


def moe_mlp(x: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array,
            w_down: jax.Array, *, top_k: int, normalize: bool, activation: str = "silu",
            mesh: Mesh | None = None, expert_axis: str | None = None) -> jax.Array:
    """The MoE MLP of one layer: x [N, D] -> [N, D] in x.dtype.

    router [E, D]; w_gate, w_up [E, D, F]; w_down [E, F, D]. Each token's output is
    sum_k weight_k * down(act(x @ gate_e) * (x @ up_e)) over its top-k experts e.

    With ``mesh`` and ``expert_axis`` the experts are split over that mesh axis (see
    ``_moe_sharded``); without them, or when the axis does not divide E, every device
    computes all routed experts.
    """
    weights = (w_gate, w_up, w_down)
    return _moe(x, router, weights, _swiglu_experts, top_k=top_k, normalize=normalize,
                activation=activation, mesh=mesh, expert_axis=expert_axis)


def moe_mlp_fused(x: jax.Array, router: jax.Array, w_gate_up: jax.Array, w_down: jax.Array,
                  *, top_k: int, normalize: bool, activation: str = "silu",
                  mesh: Mesh | None = None, expert_axis: str | None = None) -> jax.Array:
    """``moe_mlp`` with gate and up fused: w_gate_up [E, D, 2F] (gate in [..., :F], up in
    [..., F:], the order of HF's ``experts.gate_up_proj`` once transposed), w_down [E, F, D].
    One grouped matmul reads x's sorted rows once for both."""
    weights = (w_gate_up, w_down)
    return _moe(x, router, weights, _fused_experts, top_k=top_k, normalize=normalize,
                activation=activation, mesh=mesh, expert_axis=expert_axis)


def moe_mlp_all_experts(x: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                        w_down: jax.Array, *, top_k: int, normalize: bool,
                        activation: str = "silu") -> jax.Array:
    """``moe_mlp`` computed densely, as a reference and a baseline for benches: every expert on
    every token, each weighted by its routing weight (zero where not chosen). E/k times the
    FLOPs and every expert's weights read: what ``lax.ragged_dot`` lowers to off TPU. A NaN
    in any expert reaches every token (0 * NaN). Shapes as ``moe_mlp``; [N, D] in x.dtype."""
    act = _activation(activation)
    n, num_experts = x.shape[0], router.shape[0]
    route_w, route_e = route(x, router, top_k, normalize)                      # [N, k] x2
    dense_w = jnp.zeros((n, num_experts), jnp.float32).at[
        jnp.arange(n)[:, None], route_e].set(route_w).astype(x.dtype)         # [N, E]
    f32 = jnp.float32
    gate = jnp.einsum("ND,EDF->ENF", x, w_gate, preferred_element_type=f32).astype(x.dtype)
    up = jnp.einsum("ND,EDF->ENF", x, w_up, preferred_element_type=f32).astype(x.dtype)
    y = jnp.einsum("ENF,EFD->END", act(gate) * up, w_down, preferred_element_type=f32)
    y = y.astype(x.dtype) * dense_w.T[:, :, None]                              # [E, N, D]
    return jnp.sum(y.astype(f32), axis=0).astype(x.dtype)


def _activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


def _swiglu_experts(xs, sizes, weights, act):
    """SwiGLU per expert over sorted rows: xs [M, D], sizes [E'] -> [M, D]."""
    w_gate, w_up, w_down = weights
    h = act(grouped_matmul(xs, w_gate, sizes)) * grouped_matmul(xs, w_up, sizes)   # [M, F]
    return grouped_matmul(h, w_down, sizes)


def _fused_experts(xs, sizes, weights, act):
    """``_swiglu_experts`` with w_gate_up [E', D, 2F]."""
    w_gate_up, w_down = weights
    gate, up = jnp.split(grouped_matmul(xs, w_gate_up, sizes), 2, axis=-1)        # [M, F] x2
    return grouped_matmul(act(gate) * up, w_down, sizes)


def _moe(x, router, weights, experts_fn, *, top_k, normalize, activation, mesh, expert_axis):
    act = _activation(activation)
    num_experts = router.shape[0]
    body = functools.partial(_routed_sum, experts_fn=experts_fn, act=act, top_k=top_k,
                             normalize=normalize)
    shards = mesh.shape[expert_axis] if mesh is not None and expert_axis is not None else 1
    if shards == 1 or num_experts % shards:
        return body(x, router, weights, first_expert=0).astype(x.dtype)
    return _moe_sharded(x, router, weights, body, mesh=mesh, expert_axis=expert_axis)


def _moe_sharded(x, router, weights, body, *, mesh: Mesh, expert_axis: str) -> jax.Array:
    """The expert-parallel form of ``moe_mlp(..., mesh=, expert_axis=)``.

    Inside ``shard_map`` over ``expert_axis`` only (the mesh's other axes stay automatic, so x
    may be sharded over a data axis): the expert weights are split on their leading E axis, so
    device i holds experts [i*E/n, (i+1)*E/n); x and the router are replicated over the axis.
    Each device routes every token, multiplies the rows routed to its own experts (the others
    are sorted past the end and come out zero) and the float32 partial sums are added by
    ``psum``: the same products as the unsharded call, summed in another order.
    """
    shards = mesh.shape[expert_axis]
    local_experts = router.shape[0] // shards
    # Each device's first expert, handed in split over the axis: ``lax.axis_index`` would lower
    # to a partition id, which XLA's SPMD partitioner refuses where the other axes stay
    # automatic (TPU decoding plans).
    firsts = jnp.arange(shards, dtype=jnp.int32) * local_experts

    def local(x, router, weights, first):
        part = body(x, router, weights, first_expert=first[0])                  # [N, D] f32
        return jax.lax.psum(part, expert_axis)

    weight_specs = tuple(P(expert_axis) for _ in weights)
    out = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), weight_specs, P(expert_axis)),
                        out_specs=P(), axis_names=frozenset({expert_axis}))(
                            x, router, weights, firsts)
    return out.astype(x.dtype)


def _routed_sum(x, router, weights, *, first_expert, experts_fn, act, top_k, normalize):
    """The contributions of experts [first_expert, first_expert + E') to every token, with
    E' the leading size of ``weights``: x [N, D] -> float32 [N, D]. Assignments to other
    experts are sorted after the local ones and left out of the group sizes, so their rows
    are zero and never multiplied."""
    n = x.shape[0]
    local_experts = weights[0].shape[0]
    route_w, route_e = route(x, router, top_k, normalize)                      # [N, k] x2
    local = route_e.reshape(-1) - first_expert                                  # [M]
    key = jnp.where((local >= 0) & (local < local_experts), local, local_experts)
    order = jnp.argsort(key, stable=True)                                       # [M]
    sizes = jnp.bincount(key, length=local_experts).astype(jnp.int32)           # [E'] (drops E')
    xs = x[order // top_k]                                                      # [M, D]
    ys = experts_fn(xs, sizes, weights, act)                                    # [M, D]
    # Back to (token, choice) order: sorted row j holds assignment order[j].
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(n, top_k, -1)              # [N, k, D]
    # HF casts the routing weights to the hidden dtype before scaling (Qwen3-MoE; Mixtral
    # scales in float32 and rounds after); the k choices are summed in float32 here, where
    # HF adds them into a hidden-dtype buffer in expert order.
    scaled = y * route_w.astype(x.dtype)[..., None]
    return jnp.sum(scaled.astype(jnp.float32), axis=1)
