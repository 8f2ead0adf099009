"""Named target presets: a YAML file per model in ``configs/``, shipped with the package.

A preset file::

    name: llama-3.1-8b-instruct
    target: {arch: llama, vocab_size: 128256, ...}   # TargetConfig fields
    weights: null          # or "builtin:smollm2-135m-instruct"; null = pass --target PATH
    draft_head: null       # or "builtin:NAME": the EAGLE-3 head shipped for these weights in
                           # eagle3_jax/heads/NAME/ (decoding then defaults to EAGLE)
    mesh: {data: 1, fsdp: 1, tensor: -1}               # MeshConfig; -1 = all remaining devices
    notes: free text

``load_preset("llama-3.1-8b-instruct")`` reads ``configs/llama-3.1-8b-instruct.yaml``;
``load_preset("path/to/file.yaml")`` reads that file. ``configs/`` also holds the training
configs (``train-*.yaml``, whose ``target`` is a preset *name*); :func:`train_config_path` finds
those by name the same way.

Where ``configs/`` lives: at the top of the repository, with ``eagle3_jax/configs`` a symlink to
it, so a source checkout, an editable install and ``PYTHONPATH=<repo>`` all read the repo's
files; a wheel (and an sdist) holds real copies as package data. Either way it is found with
``importlib.resources`` (:data:`CONFIGS_DIR`), never relative to the working directory.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from eagle3_jax.errors import Eagle3Error
from eagle3_jax.model.config import ConfigError, TargetConfig
from eagle3_jax.sharding import MeshConfig, MeshError

# The shipped configs/ folder: a Path for every on-disk install (a Traversable in general).
CONFIGS_DIR: Traversable = importlib.resources.files("eagle3_jax") / "configs"
BUILTIN_WEIGHTS = ("builtin:smollm2-135m-instruct",)
DEFAULT_PRESET = "smollm2-135m"
_KEYS = ("name", "target", "weights", "draft_head", "mesh", "notes")
BUILTIN_PREFIX = "builtin:"


class PresetError(Eagle3Error, ValueError):
    """An unknown or malformed preset; the message lists what is available or wrong."""


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    target: TargetConfig
    weights: str | None = None  # "builtin:..." or None (the user passes a checkpoint path)
    draft_head: str | None = None  # "builtin:NAME" (eagle3_jax/heads/NAME) or None
    mesh: MeshConfig = MeshConfig()
    notes: str = ""


def list_presets() -> list[str]:
    """Names of the target presets in ``configs/``, sorted.

    ``configs/`` also holds other YAML (training configs, whose ``target`` is a preset *name*);
    a target preset is a file whose ``target`` is a mapping.
    """
    return sorted(name for name, file in _shipped_yaml().items() if _is_preset_file(file))


def list_train_configs() -> list[str]:
    """Names of the training configs in ``configs/`` (every YAML there that is not a preset)."""
    return sorted(name for name, file in _shipped_yaml().items() if not _is_preset_file(file))


def _shipped_yaml() -> dict[str, Traversable]:
    return {f.name.removesuffix(".yaml"): f for f in CONFIGS_DIR.iterdir()
            if f.name.endswith(".yaml") and f.is_file()}


def _is_preset_file(path: Traversable) -> bool:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and isinstance(data.get("target"), dict)


def _shipped_file(name: str) -> Traversable | None:
    # "name" or "name.yaml" of a file directly in configs/ (no folders: a path is a path).
    stem = name.removesuffix(".yaml")
    if not stem or "/" in stem or "\\" in stem:
        return None
    return _shipped_yaml().get(stem)


def preset_path(name_or_path: str | Path) -> Path | Traversable:
    """The YAML file of a preset name, or the given path if it is an existing file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    shipped = _shipped_file(str(name_or_path))
    if shipped is not None and _is_preset_file(shipped):
        return shipped
    raise PresetError(
        f"unknown preset {str(name_or_path)!r}; available presets: "
        f"{', '.join(list_presets()) or '(none)'} (or give the path of a .yaml file)"
    )


def train_config_path(name_or_path: str | Path) -> Path | Traversable:
    """A training config: the given path if it is an existing file, else the shipped
    ``configs/<name>.yaml`` of that name (``train-smollm2-135m`` or ``train-smollm2-135m.yaml``).

    Raises ConfigError listing the shipped training configs when it is neither.
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = _shipped_file(str(name_or_path))
    if shipped is not None and not _is_preset_file(shipped):
        return shipped
    raise ConfigError(
        f"train config {str(name_or_path)!r} is neither an existing file nor a shipped config; "
        f"shipped: {', '.join(list_train_configs()) or '(none)'}"
    )


def load_preset(name_or_path: str | Path) -> Preset:
    """Read and validate a preset by name (``configs/<name>.yaml``) or YAML path."""
    path = preset_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise PresetError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise PresetError(f"{path} must hold a mapping with keys {list(_KEYS)}")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise PresetError(f"{path}: unknown keys {unknown}; allowed: {list(_KEYS)}")
    if not isinstance(data.get("target"), dict):
        raise PresetError(f"{path}: 'target' must be a mapping of TargetConfig fields")
    weights = data.get("weights")
    if weights is not None and weights not in BUILTIN_WEIGHTS:
        raise PresetError(f"{path}: weights must be null or one of {list(BUILTIN_WEIGHTS)}, "
                          f"got {weights!r}")
    draft_head = data.get("draft_head")
    if draft_head is not None and not (isinstance(draft_head, str)
                                       and draft_head.startswith(BUILTIN_PREFIX)):
        raise PresetError(f"{path}: draft_head must be null or 'builtin:NAME' (a head shipped in "
                          f"eagle3_jax/heads/NAME), got {draft_head!r}")
    try:
        target = TargetConfig.from_dict(_floats(data["target"]))
        mesh = MeshConfig(**(data.get("mesh") or {}))
    except (ConfigError, MeshError, TypeError) as e:
        raise PresetError(f"{path}: {e}") from None
    return Preset(name=str(data.get("name") or Path(path.name).stem), target=target,
                  weights=weights, draft_head=draft_head, mesh=mesh,
                  notes=str(data.get("notes") or "").strip())


def _floats(target: dict[str, Any]) -> dict[str, Any]:
    # YAML 1.1 reads "1e-5" (no dot) as a string; accept it for the float fields.
    out = dict(target)
    for key in ("rms_norm_eps", "rope_theta"):
        if isinstance(out.get(key), str):
            try:
                out[key] = float(out[key])
            except ValueError:
                pass
    return out
