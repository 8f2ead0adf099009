"""Load an HF safetensors checkpoint folder into sharded target params, tensor by tensor.

Folder layout: ``config.json`` plus ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (or, failing both, every ``*.safetensors`` in the folder).

Host memory: every file is memory-mapped; headers are read first, so names and shapes are all
checked before any weight is read. Parameters are then built one at a time: a stacked ``[L, ...]``
parameter gets one host buffer, filled layer by layer straight from the mapped file (dtype cast
included), placed on the mesh (each device receives only its slice) and dropped before the next
parameter starts. Peak host memory is therefore the largest single stacked parameter, not the
model, so a 70B checkpoint never needs two copies of the model in RAM.

We parse the safetensors header ourselves (8-byte length, JSON, raw data; the format is that
small) rather than use ``safetensors.safe_open``: its numpy backend cannot return bfloat16, and
its flax backend copies every tensor onto the default device first. ``ml_dtypes`` gives numpy a
bfloat16 / float8 dtype, so a bf16 tensor is a zero-copy view of the mapped file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

import jax
import numpy as np
from jax.sharding import Mesh

from eagle3_jax.checkpoints.hf_names import (UnknownTensorError, canonical_name, hf_to_param,
                                             param_to_hf)
from eagle3_jax.checkpoints.safetensors_io import SafetensorsError, SafetensorsFile
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.model.config import ConfigError, TargetConfig
from eagle3_jax.model.params import Params, is_spec, param_specs
from eagle3_jax.sharding import param_shardings, shard_array

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"



class CheckpointError(Eagle3Error, ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor and the fix."""


# ---------------------------------------------------------------------------------------------
# Shared by the safetensors and GGUF loaders: expected names, shape checks, sharded assembly.


def expected_hf_tensors(cfg: TargetConfig) -> dict[str, tuple[tuple[str, ...], int | None]]:
    """HF name -> (path in our tree, layer or None) for every tensor ``cfg`` needs.

    Names come from ``hf_names.param_to_hf`` run on a miniature copy of the config (same layer
    count and architecture flags, 1-2 wide dims), so the name table has a single source.
    """
    tiny = cfg.replace(vocab_size=2, hidden_size=2, intermediate_size=2, num_heads=1,
                       num_kv_heads=1, head_dim=2, dtype="float32")
    tiny_params = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), param_specs(tiny),
                               is_leaf=is_spec)
    table = {}
    for name, value in param_to_hf(tiny, tiny_params).items():
        path, layer, _ = hf_to_param(name, value, tiny)
        table[name] = (tuple(path), layer)
    return table


def hf_shape(cfg: TargetConfig, path: tuple[str, ...]) -> tuple[int, ...]:
    """The ``[out, in]`` shape HF stores for one layer of our parameter at ``path``."""
    spec = _spec_at(param_specs(cfg), path)
    lead = 2 if path[-1].startswith("expert_") else 1  # [L, ...] or [L, E, ...]
    shape = spec.shape[lead:] if path[0] == "layers" else spec.shape
    key = path[-1]
    if key in ("wq", "wk", "wv"):  # ours [D, heads, H]
        return (shape[1] * shape[2], shape[0])
    if key == "wo":  # ours [N, H, D]
        return (shape[2], shape[0] * shape[1])
    if key in ("bq", "bk", "bv"):  # ours [heads, H]
        return (shape[0] * shape[1],)
    if key in ("w_gate", "w_up", "w_down", "lm_head", "expert_gate", "expert_up", "expert_down"):
        return tuple(reversed(shape))
    return tuple(shape)


def _slots(cfg: TargetConfig, path: tuple[str, ...]) -> list[tuple[int, ...] | int]:
    """The slots one checkpoint tensor fills in the stacked parameter at ``path``: each layer,
    or each (layer, expert) of an expert weight."""
    if path[-1].startswith("expert_"):
        return [(layer, e) for layer in range(cfg.num_layers) for e in range(cfg.num_experts)]
    return list(range(cfg.num_layers))


def _spec_at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def format_names(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def check_tensor_names(
    found: dict[str, tuple[int, ...]], cfg: TargetConfig, source: str,
    expected: dict[str, tuple[tuple[str, ...], int | None]] | None = None,
) -> dict[str, tuple[tuple[str, ...], int | None]]:
    """Check HF-named tensors ``found`` (name -> shape) against what ``cfg`` needs.

    Returns the expected table. Raises CheckpointError naming missing tensors, unexpected
    tensors, or the first shape mismatches (expected vs found).
    """
    expected = expected_hf_tensors(cfg) if expected is None else expected
    unexpected, mismatched = [], []
    for name, shape in found.items():
        if name in expected:
            want = hf_shape(cfg, expected[name][0])
            if tuple(shape) != want:
                mismatched.append(f"{name}: expected {want}, found {tuple(shape)}")
            continue
        try:  # rotary buffers and a tied lm_head are legitimately skipped
            skipped = hf_to_param(name, np.zeros((0,)), cfg) is None
        except (UnknownTensorError, ValueError, IndexError):
            skipped = False
        if not skipped:
            unexpected.append(name)
    missing = sorted(set(expected) - set(found))
    dims = (f"{cfg.arch}, hidden {cfg.hidden_size}, mlp {cfg.intermediate_size}, "
            f"{cfg.num_layers} layers, {cfg.num_heads} heads / {cfg.num_kv_heads} kv of "
            f"{cfg.head_dim}, vocab {cfg.vocab_size}")
    if mismatched:
        raise CheckpointError(
            f"{source}: {len(mismatched)} tensor shape(s) do not match the config ({dims}): "
            + "; ".join(mismatched[:8]) + (" ..." if len(mismatched) > 8 else "")
        )
    if missing:
        raise CheckpointError(
            f"{source}: {len(missing)} tensor(s) the config ({dims}) needs are missing: "
            f"{format_names(missing)}"
        )
    if unexpected:
        raise CheckpointError(
            f"{source}: {len(unexpected)} unexpected tensor(s) that a {cfg.arch} model with "
            f"this config does not have: {format_names(unexpected)}"
        )
    return expected


def assemble_params(
    cfg: TargetConfig,
    mesh: Mesh,
    mode: str,
    read: Callable[[tuple[str, ...], int | None], np.ndarray],
) -> Params:
    """Build the sharded param tree one parameter at a time.

    ``read(path, slot)`` returns one layer, one (layer, expert) of an expert weight, or (slot
    None) the whole unstacked parameter, in our layout.
    Each stacked parameter is filled into one host buffer of ``cfg.dtype``, placed on ``mesh``
    with the ``mode`` sharding rules, and released before the next parameter is read.
    """
    specs = param_specs(cfg)
    shardings = param_shardings(specs, mesh, mode)
    dtype = np.dtype(jax.numpy.dtype(cfg.dtype))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    flat_shardings = jax.tree.leaves(shardings)
    out = []
    for (key_path, spec), sharding in zip(leaves, flat_shardings):
        path = tuple(k.key for k in key_path)
        buffer = np.empty(spec.shape, dtype)
        if path[0] == "layers":
            for slot in _slots(cfg, path):
                buffer[slot] = read(path, slot)
        else:
            buffer[...] = read(path, None)
        out.append(shard_array(buffer, spec, sharding))
        del buffer
    return jax.tree.unflatten(treedef, out)


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF folder (index, single file, or all ``*.safetensors``)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(
                f"{index} references shard file(s) missing from {folder}: "
                f"{format_names(missing)}; download the complete checkpoint"
            )
        return [folder / n for n in names]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in folder.iterdir())[:10]
        raise CheckpointError(
            f"no safetensors weights in {folder} (looked for {SINGLE_FILE}, {INDEX_FILE}, "
            f"*.safetensors; found {found}); PyTorch .bin checkpoints must be converted first"
        )
    return files


def read_hf_config(folder: str | Path, dtype: str | None = None) -> TargetConfig:
    """TargetConfig from ``folder/config.json``; dtype None -> the checkpoint's float dtype."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(
            f"{folder} has no config.json; an HF checkpoint folder needs config.json and "
            "*.safetensors"
        )
    try:
        hf = json.loads(config_path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{config_path} is not valid JSON ({e})") from None
    if dtype is None:
        saved = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
        dtype = saved if saved in ("float32", "bfloat16", "float16") else "float32"
    try:
        return TargetConfig.from_hf_config(hf, dtype=dtype)
    except ConfigError as e:
        raise CheckpointError(f"{config_path}: {e}") from None


def load_safetensors(
    folder: str | Path,
    mesh: Mesh,
    *,
    mode: str = "serving",
    dtype: str | None = None,
    cfg: TargetConfig | None = None,
) -> tuple[TargetConfig, Params]:
    """Load an HF checkpoint folder onto ``mesh``.

    Args:
      folder: holds ``config.json`` and the safetensors weights.
      mesh: the (data, fsdp, tensor) mesh; params get ``param_shardings(..., mode)``.
      dtype: parameter dtype ("float32", "bfloat16", "float16"); None keeps the checkpoint's.
      cfg: use this config instead of reading config.json (it must match the weights).
    Returns:
      ``(cfg, params)``, params sharded on ``mesh``.
    Raises:
      CheckpointError naming the missing file, tensor or shape, or the unsupported model.
    """
    folder = Path(folder)
    if cfg is None:
        cfg = read_hf_config(folder, dtype)
    elif dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    try:
        files = [SafetensorsFile(p) for p in checkpoint_files(folder)]
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    where: dict[str, tuple[SafetensorsFile, str]] = {}  # canonical name -> (file, its name)
    for f in files:
        for stored in f.entries:
            name = canonical_name(stored)
            if name in where:
                raise CheckpointError(f"tensor {name!r} appears twice, in "
                                      f"{where[name][0].path.name} and {f.path.name}")
            where[name] = (f, stored)
    found = {name: f.entries[stored][1] for name, (f, stored) in where.items()}
    expected = check_tensor_names(found, cfg, str(folder))
    by_slot = {slot: name for name, slot in expected.items()}

    def read(path, slot):
        f, stored = where[by_slot[(path, slot)]]
        _, _, value = hf_to_param(stored, f.tensor(stored), cfg)
        return value

    return cfg, assemble_params(cfg, mesh, mode, read)

