"""Load a llama.cpp GGUF file (llama / mistral / qwen2 / qwen3) into sharded target params.

Three things differ from an HF checkpoint:

* **Names.** ``token_embd``, ``blk.N.attn_q`` ... are renamed to the HF names (``GGUF_TO_HF``),
  then go through the same ``hf_names.hf_to_param`` mapping as safetensors.
* **Shapes.** GGUF lists dimensions in ggml order (fastest first), the reverse of numpy; the
  arrays ``gguf.GGUFReader`` and ``gguf.quants.dequantize`` return are already numpy order, i.e.
  HF's ``[out, in]``.
* **q/k rows.** llama.cpp's converter reorders the rows of ``attn_q`` / ``attn_k`` of Llama-family
  models from HF's rotate-half RoPE layout to its interleaved one, per head:
  ``w.reshape(heads, 2, hd // 2, D).swapaxes(1, 2)`` - row ``(i, j)`` (half i, pair j) moves to
  ``(j, i)``. The inverse is the same swap read the other way:
  ``w.reshape(heads, hd // 2, 2, D).swapaxes(1, 2).reshape(heads * hd, D)`` (``unpermute_qk``).
  Qwen2/Qwen3 are converted without the permutation (llama.cpp runs them with NeoX RoPE, which is
  HF's layout), so their rows are kept.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized to float32 one at a time, then cast to the
requested dtype; parameters are assembled one at a time as in the safetensors loader.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh

from eagle3_jax.checkpoints.hf_names import hf_to_param
from eagle3_jax.checkpoints.safetensors_loader import (
    CheckpointError, assemble_params, check_tensor_names,
)
from eagle3_jax.model.config import ConfigError, RopeScaling, TargetConfig
from eagle3_jax.model.params import Params

GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# Architectures whose q/k rows llama.cpp's converter permutes (see the module docstring).
_PERMUTED_ARCHS = ("llama", "mistral")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
# Tensors llama.cpp stores that the forward does not need as weights (rope_freqs is turned into
# the RoPE scaling config instead).
_SKIPPED = ("rope_freqs.weight",)


def gguf_to_hf_name(name: str) -> str | None:
    """HF tensor name of a GGUF tensor, or None if the name is not one we know."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    return None


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: ``[heads*hd, D]`` interleaved -> HF rotate-half."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: str | Path):
    """``gguf.GGUFReader`` over ``path`` (memory-mapped), or CheckpointError if it is not GGUF."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError, ...
        raise CheckpointError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                              "re-download it or pass an HF checkpoint folder") from None


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_config(reader, dtype: str = "float32", source: str = "GGUF") -> TargetConfig:
    """TargetConfig from GGUF metadata (``{arch}.block_count``, ``.embedding_length`` ...)."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise CheckpointError(f"{source}: GGUF architecture {arch!r} is not supported; "
                              f"eagle3_jax runs {', '.join(GGUF_ARCHS)}")
    tensors = {t.name for t in reader.tensors}

    def need(key):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise CheckpointError(f"{source}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        if tokens is None:
            raise CheckpointError(f"{source}: GGUF has neither {arch}.vocab_size nor a token list")
        vocab = len(tokens)
    try:
        cfg = TargetConfig(
            arch=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            dtype=dtype,
        )
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from None
    return cfg.replace(rope_scaling=_rope_scaling(reader, arch, cfg, source))


def _rope_scaling(reader, arch: str, cfg: TargetConfig, source: str) -> RopeScaling | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind == "linear":
        factor = float(_field(reader, f"{arch}.rope.scaling.factor"))
        return RopeScaling(kind="linear", factor=factor)
    if kind not in (None, "none"):
        raise CheckpointError(f"{source}: GGUF rope scaling {kind!r} is not supported")
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is None:
        return None
    # Llama 3.1 GGUFs store the per-frequency divisors instead of the llama3 parameters. Take the
    # published parameters (low 1, high 4, original context 8192 unless the metadata says) with
    # the largest divisor as the factor, and accept them only if they reproduce the tensor.
    divisors = np.asarray(rope_freqs.data, np.float64).reshape(-1)
    orig = int(_field(reader, f"{arch}.rope.scaling.original_context_length", 8192))
    scaling = RopeScaling(kind="llama3", factor=float(divisors.max()),
                          original_max_position_embeddings=orig)
    from eagle3_jax.model.layers import rope_inv_freq

    base = np.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, None), np.float64)
    scaled = np.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, scaling), np.float64)
    if divisors.shape != base.shape or not np.allclose(base / scaled, divisors, rtol=1e-4):
        raise CheckpointError(f"{source}: rope_freqs.weight does not match llama3 RoPE scaling "
                              "(factor, low 1, high 4); this GGUF's RoPE is not supported")
    return scaling


def load_gguf(
    path: str | Path,
    mesh: Mesh,
    *,
    mode: str = "serving",
    dtype: str | None = None,
) -> tuple[TargetConfig, Params]:
    """Load a GGUF file onto ``mesh``, dequantizing tensor by tensor.

    Args:
      path: a ``.gguf`` file (llama, mistral, qwen2 or qwen3 architecture).
      mesh: the (data, fsdp, tensor) mesh; params get ``param_shardings(..., mode)``.
      dtype: parameter dtype; None -> float32 (the dequantized values are float32).
    Returns:
      ``(cfg, params)``, params sharded on ``mesh``.
    """
    from gguf.quants import dequantize

    path = Path(path)
    reader = open_gguf(path)
    cfg = gguf_config(reader, dtype or "float32", str(path))
    by_hf: dict[str, Any] = {}
    unknown = []
    for t in reader.tensors:
        hf_name = gguf_to_hf_name(t.name)
        if hf_name is None:
            if t.name not in _SKIPPED:
                unknown.append(t.name)
            continue
        by_hf[hf_name] = t
    if unknown:
        raise CheckpointError(f"{path}: unexpected GGUF tensors {sorted(unknown)[:8]}")
    # ggml lists shapes fastest-dimension first; numpy / HF order is the reverse.
    found = {name: tuple(int(s) for s in reversed(t.shape.tolist())) for name, t in by_hf.items()}
    expected = check_tensor_names(found, cfg, str(path))
    by_slot = {slot: name for name, slot in expected.items()}
    permute = cfg.arch in _PERMUTED_ARCHS

    def read(slot_path, layer):
        name = by_slot[(slot_path, layer)]
        t = by_hf[name]
        value = dequantize(t.data, t.tensor_type).reshape(found[name])
        if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads
            value = unpermute_qk(value, heads)
        return hf_to_param(name, value, cfg)[2]

    return cfg, assemble_params(cfg, mesh, mode, read)
