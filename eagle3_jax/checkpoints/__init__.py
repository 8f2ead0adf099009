"""Checkpoint loading: HF safetensors folders, GGUF files, the default model, ``load_target``.

Exports are resolved lazily (PEP 562), so ``python -m eagle3_jax.checkpoints.default_model``
and ``eagle3_jax.checkpoints.hf_names`` do not import jax and every loader first.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ModelUnavailableError": "default_model",
    "cache_dir": "default_model",
    "default_model_path": "default_model",
    "gguf_config": "gguf_loader",
    "load_gguf": "gguf_loader",
    "open_gguf": "gguf_loader",
    "unpermute_qk": "gguf_loader",
    "LoadedTarget": "load",
    "load_target": "load",
    "CheckpointError": "safetensors_loader",
    "load_safetensors": "safetensors_loader",
    "read_hf_config": "safetensors_loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
