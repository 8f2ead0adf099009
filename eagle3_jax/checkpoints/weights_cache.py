"""A cache of serving-layout target weights, so a second start skips dequantising and fusing.

After a target is loaded for serving (a GGUF dequantised to float32, or an HF folder, then
converted to the serving layout), its params are written once to::

    $EAGLE3_JAX_HOME/weights/<name>-<key>.safetensors

``key`` hashes what the arrays depend on: the source file(s) (resolved path, size, mtime),
the dtype, the serving layout version (:data:`LAYOUT_VERSION`, bumped whenever
``model.params.to_serving`` changes what it writes) and the target config. The file holds the
config in its metadata, so a hit needs no other read of the source. Writes are atomic (a
temporary file, then a rename); a stale source gets a new key, and a corrupt or unreadable
entry is deleted and rebuilt. ``EAGLE3_JAX_WEIGHTS_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from eagle3_jax.checkpoints.safetensors_io import (SafetensorsError, SafetensorsFile,
                                                   write_safetensors)
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import Params, is_spec, serving_specs

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1
ENV_SWITCH = "EAGLE3_JAX_WEIGHTS_CACHE"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def _source_files(source: Path) -> list[Path]:
    if source.is_dir():
        return sorted([*source.glob("*.safetensors"), *source.glob("*.json")])
    return [source]


def cache_path(source: str | Path, dtype: str | None) -> Path:
    """Where the serving weights of ``source`` (a file or HF folder) in ``dtype`` are cached."""
    from eagle3_jax.checkpoints.default_model import cache_dir

    source = Path(source).resolve()
    h = hashlib.sha256(f"layout={LAYOUT_VERSION};dtype={dtype}".encode())
    for f in _source_files(source):
        stat = f.stat()
        h.update(f"{f}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return cache_dir() / "weights" / f"{source.stem}-{h.hexdigest()[:16]}.safetensors"


def _names(cfg: TargetConfig) -> tuple[list[str], Any, list[Any]]:
    """(tensor names, tree structure, specs) of the serving params, in one flattening order."""
    paths_specs, treedef = jax.tree_util.tree_flatten_with_path(serving_specs(cfg),
                                                                is_leaf=is_spec)
    names = [jax.tree_util.keystr(path, simple=True, separator=".") for path, _ in paths_specs]
    return names, treedef, [spec for _, spec in paths_specs]


def save(path: Path, params: Params, cfg: TargetConfig) -> None:
    """Write serving ``params`` of ``cfg`` to ``path``; a failure to cache is only logged."""
    names, _, _ = _names(cfg)
    leaves = jax.tree.leaves(params)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {name: np.asarray(jax.device_get(leaf)) for name, leaf in zip(names, leaves)}
        metadata = {"layout_version": str(LAYOUT_VERSION),
                    "target_config": json.dumps(dataclasses.asdict(cfg))}
        write_safetensors(path, tensors, metadata)
    except (OSError, SafetensorsError) as e:  # read-only home, full disk: start without it
        log.warning("could not cache the serving weights at %s (%s)", path, e)


def load(path: Path, shardings_for) -> tuple[TargetConfig, Params] | None:
    """(cfg, params placed by ``shardings_for(cfg)``) from ``path``, or None when missing.

    An unreadable or inconsistent entry is deleted (the caller rebuilds it).
    """
    if not path.is_file():
        return None
    try:
        f = SafetensorsFile(path)
        if f.metadata.get("layout_version") != str(LAYOUT_VERSION):
            raise SafetensorsError(f"layout version {f.metadata.get('layout_version')}")
        cfg = TargetConfig.from_dict(json.loads(f.metadata["target_config"]))
        names, treedef, specs = _names(cfg)
        if set(names) != set(f.entries):
            raise SafetensorsError("tensor names do not match the serving layout")
        arrays = [f.tensor(name) for name in names]
        for name, array, spec in zip(names, arrays, specs):
            if tuple(array.shape) != tuple(spec.shape):
                raise SafetensorsError(f"{name} has shape {array.shape}, expected {spec.shape}")
    except (OSError, ValueError, KeyError, SafetensorsError) as e:
        log.warning("rebuilding the cached serving weights %s: %s", path, e)
        path.unlink(missing_ok=True)
        return None
    shardings = jax.tree.leaves(shardings_for(cfg))
    # One tensor at a time out of the mapping into device memory (a copy: nothing keeps
    # pointing into the file, which may be replaced later).
    params = [jax.device_put(np.array(a), s) for a, s in zip(arrays, shardings)]
    return cfg, jax.tree.unflatten(treedef, params)
