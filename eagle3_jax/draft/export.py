"""Write and read a draft head in the released EAGLE-3 checkpoint format (reference §6).

A head folder holds::

    config.json         a Llama config with num_hidden_layers 1, draft_vocab_size and
                        eagle_aux_hidden_state_layer_ids (our tap layers)
    model.safetensors   PyTorch [out, in] layouts, no embed_tokens:
        fc.weight                                [D, 3D]
        midlayer.input_layernorm.weight          [D]     (ours: attn_norm, on the embedding)
        midlayer.hidden_norm.weight              [D]
        midlayer.post_attention_layernorm.weight [D]     (ours: mlp_norm)
        midlayer.self_attn.{q,k,v}_proj.weight   [heads*H, 2D]
        midlayer.self_attn.o_proj.weight         [D, N*H]
        midlayer.mlp.{gate,up}_proj.weight       [F, D];  midlayer.mlp.down_proj.weight [D, F]
        norm.weight                              [D]     (ours: final_norm)
        lm_head.weight                           [Vd, D]
        d2t                                      [Vd] int64;  t2d [V] bool
        fc_norm.weight                           [3, D]  EAGLE-3.1 heads only ("fc_norm": true
                                                 in config.json; "norm_output": true likewise
                                                 marks the normed recurrent feature)

Reading also accepts ``pytorch_model.bin`` (through torch, when installed) and the vLLM
``speculators`` layout: the Llama fields nested under ``transformer_layer_config``, the layer
named ``layers.0.`` instead of ``midlayer.``. ``norm_before_residual: true`` heads (hidden_norm
applied before the residual) compute a different function and are refused by name.

The safetensors file is written and parsed here (8-byte header length, JSON header, raw bytes)
so that bfloat16 round-trips through ``ml_dtypes`` without torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from eagle3_jax.checkpoints import safetensors_io
from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.params import DraftHead, VocabMap, draft_param_specs
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.model.config import ConfigError, TargetConfig
from eagle3_jax.model.params import Params

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TORCH_WEIGHTS_FILE = "pytorch_model.bin"
ARCHITECTURE = "LlamaForCausalLMEagle3"

class DraftExportError(Eagle3Error, ValueError):
    """A head folder that cannot be written or read; the message names the file and the fix."""


# ---------------------------------------------------------------------------------------------
# Name / layout table: our param name -> (released name, ours -> torch, torch -> ours).


def _tables(cfg: DraftConfig):
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    t = lambda x: np.ascontiguousarray(np.asarray(x).T)
    extra = {"fc_norm": ("fc_norm.weight", np.asarray, np.asarray)} if cfg.fc_norm else {}
    return {
        **extra,
        "fc": ("fc.weight", t, t),
        "attn_norm": ("midlayer.input_layernorm.weight", np.asarray, np.asarray),
        "hidden_norm": ("midlayer.hidden_norm.weight", np.asarray, np.asarray),
        "mlp_norm": ("midlayer.post_attention_layernorm.weight", np.asarray, np.asarray),
        # wq [2D, N, H] -> [N*H, 2D]; back: [N*H, 2D] -> [2D, N, H].
        "wq": ("midlayer.self_attn.q_proj.weight", lambda x: t(np.asarray(x).reshape(2 * d, n * h)),
               lambda x: t(x).reshape(2 * d, n, h)),
        "wk": ("midlayer.self_attn.k_proj.weight", lambda x: t(np.asarray(x).reshape(2 * d, k * h)),
               lambda x: t(x).reshape(2 * d, k, h)),
        "wv": ("midlayer.self_attn.v_proj.weight", lambda x: t(np.asarray(x).reshape(2 * d, k * h)),
               lambda x: t(x).reshape(2 * d, k, h)),
        # wo [N, H, D] -> [D, N*H].
        "wo": ("midlayer.self_attn.o_proj.weight", lambda x: t(np.asarray(x).reshape(n * h, d)),
               lambda x: t(x).reshape(n, h, d)),
        "w_gate": ("midlayer.mlp.gate_proj.weight", t, t),
        "w_up": ("midlayer.mlp.up_proj.weight", t, t),
        "w_down": ("midlayer.mlp.down_proj.weight", t, t),
        "final_norm": ("norm.weight", np.asarray, np.asarray),
        "lm_head": ("lm_head.weight", t, t),
    }


def released_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Released tensor name -> expected PyTorch shape, for every trained tensor."""
    specs = draft_param_specs(cfg)
    shapes = {}
    for ours, (name, to_torch, _) in _tables(cfg).items():
        shapes[name] = to_torch(np.zeros(specs[ours].shape, np.int8)).shape
    return shapes


# ---------------------------------------------------------------------------------------------
# safetensors, minimal.


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray], metadata=None) -> None:
    try:
        safetensors_io.write_safetensors(path, tensors, metadata)
    except safetensors_io.SafetensorsError as e:
        raise DraftExportError(str(e)) from None


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    try:
        return safetensors_io.SafetensorsFile(path).read_all()
    except (OSError, safetensors_io.SafetensorsError) as e:
        raise DraftExportError(f"{path} is not a readable safetensors file ({e}); re-export the "
                               "head or re-download it") from None


def _read_torch_bin(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise DraftExportError(f"{path} is a PyTorch pickle and torch is not installed; install "
                               "torch or convert the head to model.safetensors") from None
    state = torch.load(path, map_location="cpu", weights_only=True)
    out = {}
    for name, value in state.items():
        if value.dtype == torch.bfloat16:
            out[name] = value.float().numpy().astype(ml_dtypes.bfloat16)
        else:
            out[name] = value.numpy()
    return out


# ---------------------------------------------------------------------------------------------
# Export.


def head_config_json(head_cfg: DraftConfig, torch_dtype: str) -> dict[str, Any]:
    """The released ``config.json`` for ``head_cfg`` (a one-layer Llama config)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": head_cfg.hidden_size,
        "intermediate_size": head_cfg.intermediate_size,
        "num_attention_heads": head_cfg.num_heads,
        "num_key_value_heads": head_cfg.num_kv_heads,
        "head_dim": head_cfg.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": head_cfg.vocab_size,
        "draft_vocab_size": head_cfg.draft_vocab_size,
        "rms_norm_eps": head_cfg.rms_norm_eps,
        "rope_theta": head_cfg.rope_theta,
        "max_position_embeddings": head_cfg.max_position_embeddings,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": torch_dtype,
        "eagle_aux_hidden_state_layer_ids": list(head_cfg.tap_layers),
        # EAGLE-3.1 flags (absent = False: an EAGLE-3 head); fc_norm.weight [3, D] with fc_norm.
        **{k: True for k in ("fc_norm", "norm_output") if getattr(head_cfg, k)},
    }


def export_draft_head(head: DraftHead, out_dir: str | Path, *, dtype: str | None = None) -> Path:
    """Write ``head`` as ``out_dir/{config.json, model.safetensors}``; returns ``out_dir``.

    ``dtype`` ("float32", "bfloat16", "float16") casts the weights; default the head's dtype.
    """
    cfg = head.cfg
    dtype = dtype or cfg.dtype
    if dtype not in ("float32", "bfloat16", "float16"):
        raise DraftExportError(f"export dtype must be float32, bfloat16 or float16, got {dtype!r}")
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for ours, (name, to_torch, _) in _tables(cfg).items():
        value = np.asarray(jnp.asarray(head.params[ours], jnp.float32))
        tensors[name] = to_torch(value).astype(np_dtype)
    tensors["d2t"] = np.asarray(head.vocab.d2t).astype(np.int64)
    tensors["t2d"] = np.asarray(head.vocab.t2d).astype(bool)
    write_safetensors(out / WEIGHTS_FILE, tensors)
    (out / CONFIG_FILE).write_text(json.dumps(head_config_json(cfg, dtype), indent=2) + "\n")
    return out


# ---------------------------------------------------------------------------------------------
# Load.


def draft_config_from_json(hf: Mapping[str, Any], target_cfg: TargetConfig | None = None,
                           dtype: str = "float32", source: str = CONFIG_FILE) -> DraftConfig:
    """DraftConfig from a released (or speculators) ``config.json`` dict."""
    layer = dict(hf.get("transformer_layer_config") or hf)
    if hf.get("norm_before_residual"):
        raise DraftExportError(f"{source}: norm_before_residual heads are not supported (their "
                               "hidden_norm sits before the residual); use a standard EAGLE-3 head")
    try:
        hidden = int(layer["hidden_size"])
        heads = int(layer["num_attention_heads"])
        vocab = int(layer.get("vocab_size") or hf.get("vocab_size")
                    or (target_cfg.vocab_size if target_cfg else 0))
        target_hidden = hf.get("target_hidden_size", layer.get("target_hidden_size"))
        if target_hidden is not None and int(target_hidden) != hidden:
            raise DraftExportError(f"{source}: target_hidden_size {target_hidden} != hidden_size "
                                   f"{hidden}; heads narrower than their target are not supported")
        taps = hf.get("eagle_aux_hidden_state_layer_ids")
        if taps is None:
            if target_cfg is None:
                raise DraftExportError(f"{source} has no eagle_aux_hidden_state_layer_ids; pass "
                                       "target_cfg so the default taps 2, L//2, L-3 can be used")
            taps = target_cfg.eagle3_tap_layers
        return DraftConfig(
            hidden_size=hidden,
            intermediate_size=int(layer["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=int(hf.get("draft_vocab_size") or layer.get("draft_vocab_size")
                                 or vocab),
            tap_layers=tuple(taps),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(layer.get("rope_theta") or 10000.0),
            max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
            dtype=dtype,
            fc_norm=bool(hf.get("fc_norm", False)),
            norm_output=bool(hf.get("norm_output", False)),
        )
    except KeyError as e:
        raise DraftExportError(f"{source} is missing the key {e.args[0]!r}") from None
    except ConfigError as e:
        raise DraftExportError(f"{source}: {e}") from None


def load_draft_head(path: str | Path, target_cfg: TargetConfig | None = None, *,
                    dtype: str | None = None) -> DraftHead:
    """Read a head folder in the released format (see module docstring).

    Args:
      path: folder with ``config.json`` and ``model.safetensors`` (or ``pytorch_model.bin``).
      target_cfg: the target it will run with; checked with ``DraftConfig.check_fits``, and the
        source of the default taps when the config names none.
      dtype: parameter dtype; default the config's ``torch_dtype`` when float32/bf16/f16.
    Raises:
      DraftExportError naming the folder, file or tensor; ConfigError when it does not fit.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise DraftExportError(f"draft head folder {str(folder)!r} does not exist; give the "
                               "folder written by `python -m eagle3_jax.export` or an HF head repo")
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise DraftExportError(f"{folder} has no {CONFIG_FILE}; a draft head folder holds "
                               f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        hf = json.loads(config_path.read_text())
    except ValueError as e:
        raise DraftExportError(f"{config_path} is not valid JSON: {e}") from None
    saved = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
    dtype = dtype or (saved if saved in ("float32", "bfloat16", "float16") else "float32")
    cfg = draft_config_from_json(hf, target_cfg, dtype, str(config_path))
    if target_cfg is not None:
        cfg.check_fits(target_cfg)

    if (folder / WEIGHTS_FILE).is_file():
        weights_path = folder / WEIGHTS_FILE
        tensors = read_safetensors(weights_path)
    elif (folder / TORCH_WEIGHTS_FILE).is_file():
        weights_path = folder / TORCH_WEIGHTS_FILE
        tensors = _read_torch_bin(weights_path)
    else:
        raise DraftExportError(f"{folder} has no {WEIGHTS_FILE} (or {TORCH_WEIGHTS_FILE}); "
                               "re-export the head")
    tensors = {_canonical_name(k): v for k, v in tensors.items()}

    expected = released_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise DraftExportError(f"{weights_path} lacks tensors {missing}; is it an EAGLE-3 head?")
    wrong = [f"{n} {tuple(tensors[n].shape)} (expected {s})" for n, s in expected.items()
             if tuple(tensors[n].shape) != tuple(s)]
    if wrong:
        raise DraftExportError(f"{weights_path}: mis-shaped tensors for the config in "
                               f"{CONFIG_FILE}: " + "; ".join(wrong))
    params: Params = {}
    jdtype = jnp.dtype(dtype)
    for ours, (name, _, from_torch) in _tables(cfg).items():
        value = np.asarray(tensors[name], np.float32)
        params[ours] = jnp.asarray(from_torch(value), jdtype)
    return DraftHead(params=params, vocab=_vocab(tensors, cfg, weights_path), cfg=cfg)


def _canonical_name(name: str) -> str:
    """Map the speculators / vLLM spelling (``layers.0.``, ``model.`` prefix) to ours."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name


def _vocab(tensors: Mapping[str, np.ndarray], cfg: DraftConfig, source: Path) -> VocabMap:
    has_d2t, has_t2d = "d2t" in tensors, "t2d" in tensors
    if not (has_d2t and has_t2d):
        if cfg.draft_vocab_size == cfg.vocab_size and not (has_d2t or has_t2d):
            return VocabMap.identity(cfg.vocab_size)
        raise DraftExportError(f"{source} lacks d2t/t2d, which a head with draft_vocab_size "
                               f"{cfg.draft_vocab_size} < vocab_size {cfg.vocab_size} needs")
    d2t, t2d = np.asarray(tensors["d2t"]), np.asarray(tensors["t2d"]).astype(bool)
    if d2t.shape != (cfg.draft_vocab_size,) or t2d.shape != (cfg.vocab_size,):
        raise DraftExportError(f"{source}: d2t {d2t.shape} / t2d {t2d.shape} do not match "
                               f"draft_vocab_size {cfg.draft_vocab_size} / vocab {cfg.vocab_size}")
    used = np.arange(len(d2t)) + d2t
    if not np.array_equal(np.flatnonzero(t2d), used):
        raise DraftExportError(f"{source}: d2t and t2d disagree about the draft vocabulary")
    return VocabMap(jnp.asarray(d2t, jnp.int32), jnp.asarray(t2d))
