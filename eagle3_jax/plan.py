"""``python -m eagle3_jax.plan --config CONFIG --topology v5p-16 [--decode [--decode-batch N]
[--tree-tokens T]] [--json]``

Checks, on this host and before any TPU is rented, whether a training config fits a Cloud TPU
slice: the jitted training step (or, with ``--decode``, the target's verification forward of a
draft tree over a full KV cache) is compiled ahead of time for the topology through libtpu
(``jax.experimental.topologies``; no TPU needed) and XLA's memory analysis gives the HBM one
chip needs (with ``--decode`` the config may also be a target preset: its dtype, 2,048 cache
slots, ``key=value`` overrides as for training). libtpu is looked for in ``$EAGLE3_JAX_LIBTPU_SITE`` when that is set (a folder
holding the ``libtpu`` package; empty: none), else in ``<venv>/libtpu``, where ``make setup``
installs it (a folder of its own: in the venv's site-packages every JAX process would probe
for a TPU first), else beside jax (``pip install 'jax[tpu]'``). Without libtpu it says so and
prints the analytic estimate of ``eagle3_jax.sharding.tpu.mesh_plan`` instead.

``--json`` prints one object: fits, hbm_per_chip_bytes, hbm_capacity_bytes, flops (the step's
or the verification's matmul FLOPs, all chips, counted from the shapes), method ("compiled" or
"analytic"), the mesh and the breakdown. Exit status 0 when it fits, 1 when it does not, 2 on
bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

from eagle3_jax.errors import run_cli

# Chip grids libtpu compiles for, by chip count: 3-D tori (v4, v5p) and 2-D (v5e, v6e).
GRIDS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
            256: "4x8x8", 512: "8x8x8"}
GRIDS_2D = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


def aot_topology_name(topology) -> str:
    """``v5p-16`` (8 chips) -> ``v5p:2x2x2``, the name get_topology_desc takes."""
    from eagle3_jax.sharding import MeshError

    grids = GRIDS_3D if topology.chip.generation in ("v4", "v5p") else GRIDS_2D
    if topology.chips not in grids:
        raise MeshError(f"{topology.name}: no ahead-of-time layout for {topology.chips} chips "
                        f"(compiled plans cover {', '.join(map(str, grids))} chips)")
    return f"{topology.chip.aot_name}:{grids[topology.chips]}"


LIBTPU_SITE_ENV = "EAGLE3_JAX_LIBTPU_SITE"


def venv_libtpu_site() -> Path:
    """Where ``make setup`` installs libtpu: ``<sys.prefix>/libtpu``."""
    return Path(sys.prefix) / "libtpu"


def libtpu_site() -> Path | None:
    """The folder holding the ``libtpu`` package for compiled plans: ``$EAGLE3_JAX_LIBTPU_SITE``
    when set (empty: none), else ``<sys.prefix>/libtpu`` (``make setup`` installs it there)
    where it holds the package, else None (libtpu may still sit beside jax)."""
    if LIBTPU_SITE_ENV in os.environ:
        value = os.environ[LIBTPU_SITE_ENV]
        return Path(value) if value else None
    default = venv_libtpu_site()
    return default if (default / "libtpu").is_dir() else None


def tpu_devices(topology) -> list:
    """The abstract devices of ``topology``, compiled for through libtpu from
    :func:`libtpu_site` (raises if libtpu is unavailable)."""
    import jax
    from jax.experimental import topologies

    site = libtpu_site()
    if site is not None and str(site) not in sys.path:
        # JAX's backends start first, without libtpu on the path: this process compiles for the
        # topology but runs on the CPU, so it must not probe for a TPU.
        jax.devices()
        sys.path.insert(0, str(site))

    desc = topologies.get_topology_desc(platform="tpu", topology_name=aot_topology_name(topology))
    return list(desc.devices)


def _abstract(tree, shardings):
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def _abstract_params(specs, mesh, mode: str, dtype: str):
    """ShapeDtypeStructs of a target param-spec tree, placed by ``mode``'s sharding rules."""
    import jax
    import jax.numpy as jnp

    from eagle3_jax.model.params import is_spec
    from eagle3_jax.sharding import param_shardings

    def place(spec, sharding):
        return jax.ShapeDtypeStruct(spec.shape, jnp.dtype(dtype), sharding=sharding)

    return jax.tree.map(place, specs, param_shardings(specs, mesh, mode), is_leaf=is_spec)


def compile_train_step(cfg, tcfg, devices) -> Any:
    """The run's training step (online: the frozen target inside), lowered and compiled for
    ``devices`` with abstract arrays only. Returns the compiled executable."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from eagle3_jax.draft.config import DraftConfig
    from eagle3_jax.draft.params import VocabMap
    from eagle3_jax.model.params import param_specs
    from eagle3_jax.sharding import make_mesh
    from eagle3_jax.train.inputs import TargetInputs
    from eagle3_jax.sharding.activations import BATCH_AXES
    from eagle3_jax.train.loop import MASTER_DTYPE, abstract_train_state
    from eagle3_jax.train.step import train_step

    mesh = make_mesh(cfg.mesh, devices)
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.batch_size % shards:
        from eagle3_jax.model.config import ConfigError
        raise ConfigError(f"batch_size {cfg.batch_size} is not a multiple of the data x fsdp "
                          f"mesh size {shards} on this topology; raise batch_size")
    draft_cfg = DraftConfig.for_target(tcfg, draft_vocab_size=min(cfg.draft_vocab_size,
                                                                  tcfg.vocab_size),
                                       ttt_steps=cfg.ttt_steps, dtype=MASTER_DTYPE,
                                       fc_norm=cfg.fc_norm, norm_output=cfg.norm_output)
    optimizer = cfg.optimizer.build()
    frozen = _abstract_params(param_specs(tcfg), mesh, cfg.target_sharding, tcfg.dtype)
    shapes, state_sh = abstract_train_state(draft_cfg, optimizer, mesh)
    state = _abstract(shapes, state_sh)
    replicated = NamedSharding(mesh, P())
    vocab = VocabMap(d2t=jax.ShapeDtypeStruct((draft_cfg.draft_vocab_size,), jnp.int32,
                                              sharding=replicated),
                     t2d=jax.ShapeDtypeStruct((tcfg.vocab_size,), jnp.bool_, sharding=replicated))
    batch_sh = NamedSharding(mesh, P(None, BATCH_AXES, None))
    shape = (cfg.grad_accum, cfg.batch_size, cfg.max_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.bool_ if k == "loss_mask" else jnp.int32,
                                     sharding=batch_sh)
             for k in ("tokens", "loss_mask", "segment_ids", "positions")}
    step = jax.jit(
        functools.partial(train_step, make_inputs=TargetInputs(tcfg, draft_cfg),
                          draft_cfg=draft_cfg, optimizer=optimizer,
                          compute_dtype=cfg.draft_compute_dtype, loss_mask=cfg.loss_mask,
                          objective=cfg.objective),
        out_shardings=(state_sh, replicated), donate_argnums=(0,))
    with jax.set_mesh(mesh):  # activations keep the batch split (sharding/activations.py)
        return mesh, step.lower(state, frozen, vocab, batch).compile()


def compile_verification(tcfg, devices, mesh_cfg, *, batch: int, new_tokens: int,
                         max_len: int):
    """The target's forward of ``new_tokens`` (a draft tree) for ``batch`` sequences over a
    KV cache of ``max_len`` slots, serving layout, on ``mesh_cfg``, compiled for ``devices``
    (the cache donated, as decoding does). Returns (mesh, compiled)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from eagle3_jax.model.params import serving_specs
    from eagle3_jax.model.target import KVCache, forward
    from eagle3_jax.sharding import make_mesh
    from eagle3_jax.sharding.activations import BATCH_AXES
    from eagle3_jax.sharding.mesh import KV_CACHE_K_AXES, KV_CACHE_V_AXES, named_sharding

    mesh = make_mesh(mesh_cfg, devices)
    rows = NamedSharding(mesh, P(BATCH_AXES))  # sequences over the replicas
    dtype = jnp.dtype(tcfg.dtype)
    params = _abstract_params(serving_specs(tcfg), mesh, "serving", tcfg.dtype)
    b, k, h = batch, tcfg.num_kv_heads, tcfg.head_dim
    k_shape, v_shape = (b, k, h, max_len), (b, k, max_len, h)
    cache = KVCache(
        k=tuple(jax.ShapeDtypeStruct(k_shape, dtype, sharding=named_sharding(
            KV_CACHE_K_AXES, k_shape, mesh)) for _ in range(tcfg.num_layers)),
        v=tuple(jax.ShapeDtypeStruct(v_shape, dtype, sharding=named_sharding(
            KV_CACHE_V_AXES, v_shape, mesh)) for _ in range(tcfg.num_layers)),
        end=jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows))
    tokens = jax.ShapeDtypeStruct((b, new_tokens), jnp.int32, sharding=rows)
    mask = jax.ShapeDtypeStruct((b, new_tokens, max_len), jnp.bool_, sharding=rows)
    step = jax.jit(forward, static_argnums=1, donate_argnums=(5,))
    with jax.set_mesh(mesh):  # a mixture of experts runs expert-parallel (model/moe.py)
        return mesh, step.lower(params, tcfg, tokens, tokens, mask, cache).compile()


def plan(cfg, topology_name: str, *, decode: bool = False, decode_batch: int = 1,
         tree_tokens: int = 60) -> dict:
    """The plan as a dict (see the module doc); compiled where libtpu is present."""
    from eagle3_jax.presets import load_preset
    from eagle3_jax.sharding.tpu import (mesh_plan, parse_topology, train_step_flops,
                                         verify_flops)

    topology = parse_topology(topology_name)
    name = cfg.target[len("random:"):] if cfg.target.startswith("random:") else cfg.target
    tcfg = load_preset(name).target.replace(dtype=cfg.dtype)
    mode = "decode" if decode else "train"
    if decode:  # decode_batch sequences per replica: the replicas come from the plan's mesh
        replicas = mesh_plan(tcfg, topology, mode, batch_size=decode_batch,
                             max_len=cfg.max_len).mesh.data
    analytic = mesh_plan(tcfg, topology, mode,
                         batch_size=decode_batch * replicas if decode
                         else cfg.batch_size * cfg.grad_accum,
                         max_len=cfg.max_len, ttt_steps=cfg.ttt_steps,
                         draft_vocab_size=cfg.draft_vocab_size)
    if decode:
        flops = verify_flops(tcfg, sequences=decode_batch * replicas, new_tokens=tree_tokens,
                             max_len=cfg.max_len)
    else:
        flops = train_step_flops(tcfg, tokens=cfg.batch_size * cfg.grad_accum * cfg.max_len,
                                 max_len=cfg.max_len, ttt_steps=cfg.ttt_steps,
                                 draft_vocab_size=cfg.draft_vocab_size)
    # flops: the step's matmul FLOPs on all chips, counted from the shapes (XLA's cost analysis
    # counts a scanned layer once, so its figure is not the step's).
    out = {"config_target": cfg.target, "topology": topology.name, "chips": topology.chips,
           "chip": topology.chip.generation, "mode": mode, "flops": flops,
           "hbm_capacity_bytes": topology.chip.hbm_bytes}
    try:
        devices = tpu_devices(topology)
    except Exception as e:  # no libtpu, or it cannot describe this topology
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        hint = ("; install libtpu (make setup puts it in <venv>/libtpu) for XLA's own figure"
                if "TPU support" in reason or "libtpu" in reason else "")
        out.update(method="analytic", note=f"not compiled ({reason}){hint}; the analytic "
                   "estimate leaves out XLA's temporaries, which can be several times larger",
                   fits=analytic.fits, hbm_per_chip_bytes=analytic.total,
                   breakdown=analytic.bytes_per_chip,
                   mesh=dataclasses.asdict(analytic.mesh))
        return out
    # libtpu may expose a chip as two devices (v4 without megacore): capacity per device.
    capacity = topology.chip.hbm_bytes * topology.chips // len(devices)
    try:
        if decode:
            # The analytic plan's mesh; decode_batch sequences per data replica.
            mesh, compiled = compile_verification(
                tcfg, devices, analytic.mesh, batch=decode_batch * analytic.mesh.data,
                new_tokens=tree_tokens, max_len=cfg.max_len)
            out["note"] = (f"the target's verification forward of {tree_tokens} tree tokens "
                           f"for {decode_batch} sequence(s) per replica over {cfg.max_len} cache "
                           "slots; the draft head (about 1% of the weights) is not included")
        else:
            mesh, compiled = compile_train_step(cfg, tcfg, devices)
    except Exception as e:  # XLA refuses a program that cannot fit: that is the answer
        text = str(e)
        if "RESOURCE_EXHAUSTED" not in text:
            raise
        import re
        need = re.search(r"required for [^(]*\(([\d.]+)([KMGT])\)", text)
        scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
        required = int(float(need.group(1)) * scale[need.group(2)]) if need else None
        out.update(method="compiled", devices=len(devices), hbm_capacity_bytes=capacity,
                   hbm_per_chip_bytes=required, fits=False,
                   breakdown={"temporaries (at least)": required or 0},
                   mesh=(dataclasses.asdict(analytic.mesh) if decode else
                         dict(zip(("data", "fsdp", "tensor"), cfg.mesh.resolve(len(devices))))),
                   note="XLA: " + text[text.index("RESOURCE_EXHAUSTED"):].splitlines()[0],
                   analytic_hbm_per_chip_bytes=analytic.total)
        return out
    mem = compiled.memory_analysis()
    per_device = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                  + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes)
    out.update(method="compiled", devices=len(devices), hbm_capacity_bytes=capacity,
               hbm_per_chip_bytes=int(per_device), fits=bool(per_device <= capacity),
               breakdown={"arguments": mem.argument_size_in_bytes,
                          "outputs (not donated)": mem.output_size_in_bytes
                          - mem.alias_size_in_bytes,
                          "temporaries": mem.temp_size_in_bytes,
                          "code": mem.generated_code_size_in_bytes},
               mesh=dict(mesh.shape), analytic_hbm_per_chip_bytes=analytic.total)
    return out


def describe(p: dict) -> str:
    gib = 2**30
    lines = [f"{p['mode']} plan for {p['config_target']} on {p['topology']} ({p['chips']} "
             f"{p['chip']} chips), {p['method']}: mesh {p['mesh']}"]
    for k, v in p["breakdown"].items():
        lines.append(f"  {k:>22}: {v / gib:8.2f} GiB")
    lines.append(f"  {'per chip':>22}: {p['hbm_per_chip_bytes'] / gib:8.2f} GiB of "
                 f"{p['hbm_capacity_bytes'] / gib:.1f} GiB -> "
                 f"{'fits' if p['fits'] else 'does NOT fit'}")
    if p.get("flops"):
        lines.append(f"  {'FLOPs':>22}: {p['flops']:.3e} (matmuls, all chips)")
    if p.get("note"):
        lines.append(f"  note: {p['note']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True,
                        help="training config (shipped name or YAML); with --decode also a "
                             "target preset")
    parser.add_argument("--topology", required=True, help="Cloud TPU type: v5p-16, v5e-8, v6e-4")
    parser.add_argument("--decode", action="store_true", help="plan decoding, not training")
    parser.add_argument("--decode-batch", type=int, default=1,
                        help="with --decode: sequences per data-parallel replica")
    parser.add_argument("--tree-tokens", type=int, default=60,
                        help="with --decode: draft-tree tokens verified per sequence")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: dict = {}

    def body() -> None:
        from eagle3_jax.presets import list_presets, load_preset
        from eagle3_jax.train.config import load_train_config

        if args.decode and args.config in list_presets():  # a target: its dtype, 2,048 slots
            dtype = load_preset(args.config).target.dtype
            cfg = load_train_config(None, [f"target={args.config}", f"dtype={dtype}",
                                           f"compute_dtype={dtype}", *args.overrides])
        else:
            cfg = load_train_config(args.config, args.overrides)
        result.update(plan(cfg, args.topology, decode=args.decode,
                           decode_batch=args.decode_batch, tree_tokens=args.tree_tokens))
        print(json.dumps(result) if args.json else describe(result))

    code = run_cli(body, debug=args.debug)
    if code == 0 and not result.get("fits", False):
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
