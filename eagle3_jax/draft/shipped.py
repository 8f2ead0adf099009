"""Draft heads shipped inside the package, and which target each one belongs to.

A shipped head is a released-format folder (``config.json``, ``model.safetensors`` stored in
16-bit, ``acceptance.json`` with its measured per-depth hit rates, ``README.md`` its model card)
under ``eagle3_jax/heads/NAME/``. A preset names it (``draft_head: builtin:NAME``), so the head
belongs to that preset's *builtin weights*: the default target ``smollm2-135m`` decodes with
EAGLE-3 out of the box. A target given as a path (another checkpoint, even of the same
architecture) has no shipped head: its hidden states are not the ones the head was trained on.
Heads are built by one command (``launch/build_default_head.sh``), never edited by hand.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from eagle3_jax.presets import BUILTIN_PREFIX, DEFAULT_PRESET, PresetError, load_preset

HEADS_DIR = importlib.resources.files("eagle3_jax") / "heads"


def builtin_head_path(name: str) -> Path | None:
    """The folder of shipped head ``name`` (``builtin:`` prefix optional), or None if this
    install does not hold it."""
    folder = Path(str(HEADS_DIR / name.removeprefix(BUILTIN_PREFIX)))
    return folder if (folder / "config.json").is_file() else None


def shipped_head_for(target: str | None) -> Path | None:
    """The shipped head of ``target`` as the CLIs name it (None = the default preset, or a
    preset name), or None: a path, a preset without a head, or a head missing from this
    install. Reads only the preset's YAML (nothing loads)."""
    name = DEFAULT_PRESET if target is None else str(target)
    if Path(name).exists() and not name.endswith((".yaml", ".yml")):
        return None  # a checkpoint folder or file: no head was trained on its hidden states
    try:
        preset = load_preset(name)
    except PresetError:
        return None
    if preset.weights is None or preset.draft_head is None:
        return None
    return builtin_head_path(preset.draft_head)
