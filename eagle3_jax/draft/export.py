"""Write and read a draft head in the published EAGLE-3 layouts (reference §6).

Three layouts (``FORMATS``), each a folder of ``config.json`` + ``model.safetensors``:

    sglang       SGLang / SpecForge (the default; also what vLLM and eagle3_jax read): a flat
                 one-layer Llama config, ``architectures: ["LlamaForCausalLMEagle3"]``,
                 ``draft_vocab_size``, ``eagle_aux_hidden_state_layer_ids`` (our tap layers),
                 ``fc_norm: true`` for EAGLE-3.1 per-tap norms
    reference    SafeAILab/EAGLE: the same flat config as ``LlamaForCausalLM`` (its loader reads
                 ``model.safetensors`` when there is no ``pytorch_model.bin``)
    speculators  vLLM's: the Llama fields nested under ``transformer_layer_config``, the EAGLE-3
                 fields (``norm_before_residual``, ``fc_norm``, ``norm_output``, ...) at the top,
                 the layer named ``layers.0.`` instead of ``midlayer.``

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
        d2t                                      [Vd] int64;  t2d [V] bool  (speculators omits
                                                 both for a full draft vocabulary)
        fc_norm.{0,1,2}.weight                   [D]     EAGLE-3.1 heads only

A flag means what its own layout says: ``norm_output`` is vLLM's normed recurrent feature in a
speculators config and SpecForge's final norm (true = the standard head) in a flat one. A head
a layout cannot describe is not exported to it, and a config or tensor eagle3_jax would compute
differently is refused with its name, never dropped (``draft_config_from_json``,
``load_draft_head``). Reading also accepts ``pytorch_model.bin`` (through torch, when
installed), the ``model.`` name prefix and our earlier ``fc_norm.weight`` [3, D].

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
from eagle3_jax.model.config import ConfigError, RopeScaling, TargetConfig, rope_scaling_from_hf
from eagle3_jax.model.params import Params

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TORCH_WEIGHTS_FILE = "pytorch_model.bin"
ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_VERSION = "0.3.0"
# Tensors a head may carry that eagle3_jax reads around: the target's own embedding is used
# (as SGLang and vLLM do), so a stored copy is not needed.
IGNORED_TENSORS = frozenset({"embed_tokens.weight"})

class DraftExportError(Eagle3Error, ValueError):
    """A head folder that cannot be written or read; the message names the file and the fix."""


# ---------------------------------------------------------------------------------------------
# Name / layout table: our param name -> (released name, ours -> torch, torch -> ours).


def _tables(cfg: DraftConfig):
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    t = lambda x: np.ascontiguousarray(np.asarray(x).T)
    return {
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
    """Released tensor name -> expected PyTorch shape, for every trained tensor (the per-tap
    ``fc_norm.{i}.weight`` of EAGLE-3.1 heads included)."""
    specs = draft_param_specs(cfg)
    shapes = {}
    for ours, (name, to_torch, _) in _tables(cfg).items():
        shapes[name] = to_torch(np.zeros(specs[ours].shape, np.int8)).shape
    if cfg.fc_norm:
        shapes.update({f"fc_norm.{i}.weight": (cfg.hidden_size,) for i in range(cfg.num_taps)})
    return shapes


# ---------------------------------------------------------------------------------------------
# safetensors, minimal.


def weights_digest(folder: str | Path) -> str:
    """sha256 of a released head's ``model.safetensors``: what a live calibration
    (``acceptance.json``'s ``"live"``) belongs to."""
    import hashlib

    return hashlib.sha256((Path(folder) / "model.safetensors").read_bytes()).hexdigest()


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


FORMATS = ("sglang", "reference", "speculators")


def head_config_json(head_cfg: DraftConfig, torch_dtype: str, *, architecture: str = ARCHITECTURE,
                     legacy_rope: bool = False) -> dict[str, Any]:
    """The flat ``config.json`` of the SGLang / SpecForge and reference layouts for
    ``head_cfg``: a one-layer Llama config (``legacy_rope``: RoPE scaling in the reference
    code's two-key form)."""
    return {
        "architectures": [architecture],
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
        **({"rope_scaling": rope_scaling_to_hf(head_cfg.rope_scaling, legacy=legacy_rope)}
           if head_cfg.rope_scaling is not None else {}),
        "max_position_embeddings": head_cfg.max_position_embeddings,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": torch_dtype,
        "eagle_aux_hidden_state_layer_ids": list(head_cfg.tap_layers),
        # SpecForge's EAGLE-3.1 flag (per-tap fc_norm.{i}.weight); absent = an EAGLE-3 head.
        **({"fc_norm": True} if head_cfg.fc_norm else {}),
    }


def speculators_config_json(head_cfg: DraftConfig, torch_dtype: str,
                            verifier: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """vLLM ``speculators`` eagle3 ``config.json``: the layer's Llama config nested under
    ``transformer_layer_config``, the EAGLE-3 fields at the top, every flag written."""
    layer = head_config_json(head_cfg, torch_dtype, architecture="LlamaForCausalLM")
    for key in ("architectures", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
                "fc_norm"):
        layer.pop(key, None)
    verifier = dict(verifier or {})
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier.get("name_or_path"),
                         "architectures": list(verifier.get("architectures") or [])},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": head_cfg.draft_vocab_size,
        "target_hidden_size": head_cfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(head_cfg.tap_layers),
        # speculators defaults it to false and vLLM to true when absent: always written.
        "norm_before_residual": head_cfg.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": head_cfg.fc_norm,
        "norm_output": head_cfg.norm_output,
        "embed_requires_grad": False,
        "torch_dtype": torch_dtype,
    }


def rope_scaling_to_hf(scaling: RopeScaling, *, legacy: bool = False) -> dict[str, Any]:
    """A RopeScaling as HF's ``rope_scaling`` dict (what ``rope_scaling_from_hf`` reads);
    ``legacy``: the old two-key ``{"type", "factor"}`` form the reference code requires."""
    if scaling.kind == "linear":
        return {"type" if legacy else "rope_type": "linear", "factor": scaling.factor}
    return {"rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}


def _inexpressible(cfg: DraftConfig, fmt: str) -> list[str]:
    """What of ``cfg`` the layout ``fmt`` cannot say (so that a reader would compute another
    function): exporting such a head there is refused."""
    problems = []
    if fmt in ("sglang", "reference"):
        if cfg.norm_output:
            problems.append("norm_output (the normed output fed back; SpecForge's norm_output "
                            "means something else)")
        if cfg.norm_before_residual:
            problems.append("norm_before_residual")
    if fmt == "reference":
        if cfg.fc_norm:
            problems.append("fc_norm (EAGLE-3.1 per-tap norms)")
        if cfg.rope_scaling is not None and cfg.rope_scaling.kind != "linear":
            problems.append(f"{cfg.rope_scaling.kind} RoPE scaling (the reference reads linear "
                            "and dynamic only)")
    return problems


def export_draft_head(head: DraftHead, out_dir: str | Path, *, dtype: str | None = None,
                      format: str = "sglang",
                      verifier: Mapping[str, Any] | None = None) -> Path:
    """Write ``head`` as ``out_dir/{config.json, model.safetensors}``; returns ``out_dir``.

    ``format``: "sglang" (SGLang / SpecForge: ``LlamaForCausalLMEagle3``, ``midlayer.*``; the
    default, read by SGLang, vLLM and eagle3_jax), "reference" (SafeAILab/EAGLE:
    ``LlamaForCausalLM``; it loads ``model.safetensors`` when there is no
    ``pytorch_model.bin``), or "speculators" (vLLM's: ``layers.0.*``, the nested config).
    A head a format cannot describe is refused (``_inexpressible``). ``verifier``: the
    speculators config's ``{"name_or_path", "architectures"}`` of the target.
    ``dtype`` ("float32", "bfloat16", "float16") casts the weights; default the head's dtype.
    """
    cfg = head.cfg
    dtype = dtype or cfg.dtype
    if dtype not in ("float32", "bfloat16", "float16"):
        raise DraftExportError(f"export dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if format not in FORMATS:
        raise DraftExportError(f"export format must be one of {', '.join(FORMATS)}, got "
                               f"{format!r}")
    problems = _inexpressible(cfg, format)
    if problems:
        raise DraftExportError(f"the {format} layout cannot describe this head's "
                               f"{'; '.join(problems)}; export it with --format speculators")
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix = "layers.0." if format == "speculators" else "midlayer."
    tensors = {}
    for ours, (name, to_torch, _) in _tables(cfg).items():
        value = np.asarray(jnp.asarray(head.params[ours], jnp.float32))
        tensors[name.replace("midlayer.", prefix)] = to_torch(value).astype(np_dtype)
    if cfg.fc_norm:  # one [D] scale per tap, as SpecForge and speculators name them
        scales = np.asarray(jnp.asarray(head.params["fc_norm"], jnp.float32))
        tensors.update({f"fc_norm.{i}.weight": scales[i].astype(np_dtype)
                        for i in range(cfg.num_taps)})
    full = cfg.draft_vocab_size == cfg.vocab_size
    if not (full and format == "speculators"):  # speculators omits the maps of a full vocab
        tensors["d2t"] = np.asarray(head.vocab.d2t).astype(np.int64)
        tensors["t2d"] = np.asarray(head.vocab.t2d).astype(bool)
    write_safetensors(out / WEIGHTS_FILE, tensors)
    if format == "speculators":
        config = speculators_config_json(cfg, dtype, verifier)
    else:
        reference = format == "reference"
        config = head_config_json(cfg, dtype, legacy_rope=reference,
                                  architecture="LlamaForCausalLM" if reference else ARCHITECTURE)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


# ---------------------------------------------------------------------------------------------
# Load.


def is_speculators_config(hf: Mapping[str, Any]) -> bool:
    """Whether a head's config.json is vLLM's speculators layout (else flat: SGLang /
    SpecForge, the reference, or ours)."""
    return "speculators_model_type" in hf or "transformer_layer_config" in hf


def draft_config_from_json(hf: Mapping[str, Any], target_cfg: TargetConfig | None = None,
                           dtype: str = "float32", source: str = CONFIG_FILE) -> DraftConfig:
    """DraftConfig from a head's ``config.json`` dict in any of the ``FORMATS``.

    Flags are read with their own layout's meaning and refused where eagle3_jax would compute
    another function: a speculators config must say ``norm_before_residual`` (speculators
    defaults it to false, vLLM to true), ``norm_before_fc`` heads are refused; in a flat config
    ``norm_output: false`` (SpecForge: no final norm before ``lm_head``) is refused, and true is
    the standard head. RoPE scaling (``rope_scaling`` or transformers 5's ``rope_parameters``)
    is applied, or refused by kind.
    """
    speculators = is_speculators_config(hf)
    layer = dict(hf.get("transformer_layer_config") or hf)
    if speculators:
        kind = hf.get("speculators_model_type", "eagle3")
        if kind != "eagle3":
            raise DraftExportError(f"{source}: speculators_model_type {kind!r} is not an "
                                   "EAGLE-3 head (eagle3)")
        if "norm_before_residual" not in hf:
            raise DraftExportError(
                f"{source} does not say norm_before_residual, which speculators reads as false "
                "and vLLM as true; add \"norm_before_residual\": true or false to it")
        if hf.get("norm_before_fc"):
            raise DraftExportError(f"{source}: norm_before_fc heads (one norm over the three "
                                   "taps together) are not supported; use fc_norm or none")
        norm_output = bool(hf.get("norm_output", False))
    else:
        if hf.get("norm_output") is False:
            raise DraftExportError(f"{source}: norm_output false (SpecForge: no final norm before "
                                   "lm_head) is not supported")
        norm_output = False  # SpecForge's norm_output: true is the standard head
    rope = layer.get("rope_parameters") or {}
    scaling = layer.get("rope_scaling")
    if rope and rope.get("rope_type", "default") != "default":
        scaling = rope
    try:
        hidden = int(layer["hidden_size"])
        heads = int(layer["num_attention_heads"])
        vocab = int(layer.get("vocab_size") or hf.get("vocab_size")
                    or (target_cfg.vocab_size if target_cfg else 0))
        target_hidden = hf.get("target_hidden_size", layer.get("target_hidden_size"))
        if target_hidden is not None and int(target_hidden) != hidden:
            raise DraftExportError(f"{source}: target_hidden_size {target_hidden} != hidden_size "
                                   f"{hidden}; heads narrower than their target are not supported")
        taps = (hf.get("eagle_aux_hidden_state_layer_ids")
                or (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
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
            rope_theta=float(rope.get("rope_theta") or layer.get("rope_theta") or 10000.0),
            max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
            dtype=dtype,
            fc_norm=bool(hf.get("fc_norm", False)),
            norm_output=norm_output,
            norm_before_residual=bool(hf.get("norm_before_residual", False)),
            rope_scaling=rope_scaling_from_hf(scaling),
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
    if cfg.fc_norm and "fc_norm.weight" in tensors:  # our earlier [3, D] form
        stacked = tensors.pop("fc_norm.weight")
        tensors.update({f"fc_norm.{i}.weight": stacked[i] for i in range(len(stacked))})

    expected = released_shapes(cfg)
    unknown = sorted(set(tensors) - set(expected) - IGNORED_TENSORS - {"d2t", "t2d"})
    if unknown:
        raise DraftExportError(f"{weights_path} holds tensors this layout does not have: "
                               f"{unknown}; it is not a head eagle3_jax can run as written")
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
    if cfg.fc_norm:
        params["fc_norm"] = jnp.asarray(np.stack([np.asarray(tensors[f"fc_norm.{i}.weight"],
                                                             np.float32)
                                                  for i in range(cfg.num_taps)]), jdtype)
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
