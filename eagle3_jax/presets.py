"""Named target presets: a YAML file per model in ``configs/``.

A preset file::

    name: llama-3.1-8b-instruct
    target: {arch: llama, vocab_size: 128256, ...}   # TargetConfig fields
    weights: null          # or "builtin:smollm2-135m-instruct"; null = pass --target PATH
    mesh: {data: 1, fsdp: 1, tensor: -1}               # MeshConfig; -1 = all remaining devices
    notes: free text

``load_preset("llama-3.1-8b-instruct")`` reads ``configs/llama-3.1-8b-instruct.yaml``;
``load_preset("path/to/file.yaml")`` reads that file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from eagle3_jax.errors import Eagle3Error
from eagle3_jax.model.config import ConfigError, TargetConfig
from eagle3_jax.sharding import MeshConfig, MeshError

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
BUILTIN_WEIGHTS = ("builtin:smollm2-135m-instruct",)
DEFAULT_PRESET = "smollm2-135m"
_KEYS = ("name", "target", "weights", "mesh", "notes")


class PresetError(Eagle3Error, ValueError):
    """An unknown or malformed preset; the message lists what is available or wrong."""


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    target: TargetConfig
    weights: str | None = None  # "builtin:..." or None (the user passes a checkpoint path)
    mesh: MeshConfig = MeshConfig()
    notes: str = ""


def list_presets() -> list[str]:
    """Names of the target presets in ``configs/``, sorted.

    ``configs/`` also holds other YAML (training configs, whose ``target`` is a preset *name*);
    a target preset is a file whose ``target`` is a mapping.
    """
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml") if _is_preset_file(p))


def _is_preset_file(path: Path) -> bool:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and isinstance(data.get("target"), dict)


def preset_path(name_or_path: str | Path) -> Path:
    """The YAML file of a preset name, or the given path if it is an existing file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    candidate = CONFIGS_DIR / f"{name_or_path}.yaml"
    if candidate.is_file() and _is_preset_file(candidate):
        return candidate
    raise PresetError(
        f"unknown preset {str(name_or_path)!r}; available presets: "
        f"{', '.join(list_presets()) or '(none)'} (or give the path of a .yaml file)"
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
    try:
        target = TargetConfig.from_dict(_floats(data["target"]))
        mesh = MeshConfig(**(data.get("mesh") or {}))
    except (ConfigError, MeshError, TypeError) as e:
        raise PresetError(f"{path}: {e}") from None
    return Preset(name=str(data.get("name") or path.stem), target=target, weights=weights,
                  mesh=mesh, notes=str(data.get("notes") or "").strip())


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
