"""One entry point for every way of naming a target: preset, HF folder, hub id, GGUF file, or
nothing.

``load_target()`` (no argument) gives the default SmolLM2-135M-Instruct, fetched on first use.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from eagle3_jax.checkpoints import weights_cache as cached_weights
from eagle3_jax.checkpoints.default_model import default_model_path
from eagle3_jax.checkpoints.gguf_loader import load_gguf
from eagle3_jax.checkpoints.hub import TARGET_FILES, HubError, is_hub_id, resolve_hub_id
from eagle3_jax.checkpoints.safetensors_loader import CheckpointError, load_safetensors
from eagle3_jax.kernels.matmul import panels_in_use
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import Params, serving_specs, to_panels, to_serving
from eagle3_jax.presets import DEFAULT_PRESET, Preset, PresetError, list_presets, load_preset
from eagle3_jax.sharding import MeshConfig, make_mesh, param_shardings
from eagle3_jax.text.tokenizer import ChatTokenizer

_ACCEPTED = ("a preset name ({presets}), an HF checkpoint folder (config.json + *.safetensors), "
             "a Hugging Face hub id (org/name), or a .gguf file")


@dataclasses.dataclass(frozen=True)
class LoadedTarget:
    """A target ready to run: config, sharded params, tokenizer, a description of where they
    came from, the mesh, and the weights file or folder that was read."""

    cfg: TargetConfig
    params: Params
    tokenizer: ChatTokenizer
    source: str
    mesh: Mesh | None = None
    weights: Path | None = None


@dataclasses.dataclass(frozen=True)
class _Source:
    """A resolved target: an HF folder or a GGUF file, and the preset that named it (if any)."""

    kind: str  # "hf" or "gguf"
    path: Path
    preset: Preset | None = None

    @property
    def description(self) -> str:
        return f"{self.preset.name} ({self.path})" if self.preset else str(self.path)

    def tokenizer(self) -> ChatTokenizer:
        if self.kind == "hf":
            return ChatTokenizer.from_hf_folder(self.path)
        return ChatTokenizer.from_gguf(self.path)

    def read(self, mesh: Mesh, mode: str, dtype: str | None) -> tuple[TargetConfig, Params]:
        loader = load_safetensors if self.kind == "hf" else load_gguf
        cfg, params = loader(self.path, mesh, mode=mode, dtype=dtype)
        if self.preset is not None:
            _check_matches(self.preset, cfg)
        return cfg, params


def load_target(
    target: str | Path | None = None,
    *,
    mesh: Mesh | None = None,
    mode: str = "serving",
    dtype: str | None = None,
    weights_cache: bool = True,
    layout: str | None = None,
    panels: bool | None = None,
) -> LoadedTarget:
    """Load a target model and its tokenizer onto ``mesh``.

    Args:
      target: None (the ``smollm2-135m`` preset), a preset name, an HF checkpoint folder, a
        Hugging Face hub id (``org/name``: :mod:`eagle3_jax.checkpoints.hub`), or a ``.gguf``
        file.
      mesh: device mesh; None -> a single-device mesh on ``jax.devices()[0]``.
      mode: sharding rules, "serving" or "training".
      layout: "serving" (``eagle3_jax.model.to_serving``: per-layer, fused, the fast form for
        decoding, :func:`~eagle3_jax.model.forward`) or "stacked" (``lax.scan`` over the layers,
        :func:`~eagle3_jax.model.forward_stacked`, what training runs); None: serving for
        serving rules, stacked for training rules.
      dtype: parameter dtype; None -> the preset's, else the checkpoint's (float32 for GGUF).
      weights_cache: serving-layout params are read from / written to the serving-weights cache
        (:mod:`eagle3_jax.checkpoints.weights_cache`; ``EAGLE3_JAX_WEIGHTS_CACHE=0`` turns it
        off everywhere).
      panels: hold the serving matrices as panels (``eagle3_jax.model.params.to_panels``), the
        form the CPU matmul kernel streams fastest. None: where that kernel runs them, i.e. the
        serving layout in float32 on a one-device CPU mesh with the kernel built and on.
    Raises:
      CheckpointError (or PresetError) naming the path or preset and what is accepted.
    """
    if mesh is None:
        mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    source = _resolve(target)
    if dtype is None and source.preset is not None:
        dtype = source.preset.target.dtype
    layout = layout or ("serving" if mode == "serving" else "stacked")
    if layout not in ("serving", "stacked"):
        raise ValueError(f"layout must be 'serving' or 'stacked', got {layout!r}")
    use_cache = layout == "serving" and mode == "serving" and weights_cache and \
        cached_weights.enabled()
    if use_cache:
        cache_file = cached_weights.cache_path(source.path, dtype)
        hit = cached_weights.load(
            cache_file, lambda cfg: param_shardings(serving_specs(cfg), mesh, "serving"))
        if hit is not None:
            cfg, params = hit
            if source.preset is not None:
                _check_matches(source.preset, cfg)
            params = _panels(params, cfg, mesh, layout, panels)
            return LoadedTarget(cfg, params, source.tokenizer(), source.description, mesh,
                                source.path)
    cfg, params = source.read(mesh, mode, dtype)
    if layout == "serving":
        shardings = param_shardings(serving_specs(cfg), mesh, mode)
        params = to_serving(params, cfg, shardings=shardings, delete_stacked=True)
        if use_cache:
            cached_weights.save(cache_file, params, cfg)
        params = _panels(params, cfg, mesh, layout, panels)
    # The tokenizer after the weights: a damaged file gets the weights reader's error.
    return LoadedTarget(cfg, params, source.tokenizer(), source.description, mesh, source.path)


def _panels(params: Params, cfg: TargetConfig, mesh: Mesh, layout: str,
            panels: bool | None) -> Params:
    """``params`` with their matrices as panels where asked (None: where they pay)."""
    if panels is None:
        dtypes = {a.dtype for a in jax.tree.leaves(params)}
        panels = (layout == "serving" and mesh.devices.size == 1
                  and mesh.devices.flat[0].platform == "cpu" and dtypes == {jnp.dtype(jnp.float32)}
                  and panels_in_use(jnp.float32))
    if panels and layout != "serving":
        raise ValueError("panels=True needs layout='serving' (the stacked training layout has "
                         "no panel form)")
    return to_panels(params, cfg, delete_rows=True) if panels else params


def _resolve(target) -> _Source:
    if target is None:
        target = DEFAULT_PRESET
    path = Path(target)
    if path.is_dir():
        return _Source("hf", path)
    if path.is_file() and _is_gguf(path):
        return _Source("gguf", path)
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        return _preset_source(load_preset(path))
    if not path.exists() and str(target) in list_presets():
        return _preset_source(load_preset(str(target)))
    accepted = _ACCEPTED.format(presets=", ".join(list_presets()))
    if path.exists():
        raise CheckpointError(f"cannot load target {str(target)!r}: it is neither a folder nor a "
                              f"GGUF file (no GGUF magic); accepted: {accepted}")
    if is_hub_id(str(target)):
        try:
            return _Source("hf", resolve_hub_id(str(target), TARGET_FILES))
        except HubError as e:
            raise CheckpointError(f"target {str(target)!r} is no path and no preset, and as a "
                                  f"hub id: {e}") from None
    raise CheckpointError(f"target {str(target)!r} is no path, no preset and no hub id "
                          f"(org/name); accepted: {accepted}")


def _preset_source(preset: Preset) -> _Source:
    if preset.weights is None:
        raise PresetError(
            f"preset {preset.name!r} names an architecture but ships no weights; download the HF "
            "checkpoint and pass --target /path/to/hf/folder"
        )
    # The only builtin weights today (presets.BUILTIN_WEIGHTS) are SmolLM2's GGUF.
    return _Source("gguf", default_model_path(), preset)


def _check_matches(preset: Preset, cfg: TargetConfig) -> None:
    # GGUF stores eps as float32 (1e-5 -> 9.99999975e-06); compare it loosely, the rest exactly.
    want = preset.target.replace(dtype=cfg.dtype, rms_norm_eps=cfg.rms_norm_eps)
    if want != cfg or abs(preset.target.rms_norm_eps - cfg.rms_norm_eps) > 1e-9:
        diff = {k: (v, getattr(cfg, k)) for k, v in dataclasses.asdict(preset.target).items()
                if k != "dtype" and v != getattr(cfg, k)}
        raise CheckpointError(f"weights of preset {preset.name!r} do not match its config "
                              f"(preset vs file): {diff}")


def _is_gguf(path: Path) -> bool:
    if path.suffix == ".gguf":
        return True  # a damaged .gguf gets the GGUF reader's error, which is more useful
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
