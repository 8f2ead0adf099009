"""A tiny random Llama GGUF that keeps a real GGUF's tokenizer and chat template: end-to-end
runs of the data and training commands in seconds, with real text in and out."""

from pathlib import Path

import numpy as np


def write_tiny_gguf(source: str | Path, path: str | Path, *, layers: int = 4, hidden: int = 32,
                    ffn: int = 64, heads: int = 2, kv_heads: int = 1, head_dim: int = 16,
                    seed: int = 0) -> Path:
    """Write ``path``: random float16 weights of the given sizes; every ``tokenizer.*`` field of
    ``source`` (vocabulary, merges, special ids, chat template) copied."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(path), "llama")
    add = {gguf.GGUFValueType.ARRAY: writer.add_array, gguf.GGUFValueType.STRING: writer.add_string,
           gguf.GGUFValueType.UINT32: writer.add_uint32, gguf.GGUFValueType.INT32: writer.add_int32,
           gguf.GGUFValueType.BOOL: writer.add_bool}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            add[field.types[0]](name, field.contents())
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float16)

    writer.add_tensor("token_embd.weight", rand(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(p + "attn_q.weight", rand(heads * head_dim, hidden))
        writer.add_tensor(p + "attn_k.weight", rand(kv_heads * head_dim, hidden))
        writer.add_tensor(p + "attn_v.weight", rand(kv_heads * head_dim, hidden))
        writer.add_tensor(p + "attn_output.weight", rand(hidden, heads * head_dim))
        writer.add_tensor(p + "ffn_gate.weight", rand(ffn, hidden))
        writer.add_tensor(p + "ffn_up.weight", rand(ffn, hidden))
        writer.add_tensor(p + "ffn_down.weight", rand(hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
