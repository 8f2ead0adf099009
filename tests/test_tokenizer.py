"""ChatTokenizer on the real SmolLM2 GGUF: ChatML template, eos ids, cache, round trips."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from eagle3_jax.text import ChatTokenizer, TokenizerError

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def test_chatml_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.apply_chat_template(MESSAGES)
    assert all(isinstance(i, int) for i in ids)
    text = tok.decode(ids)
    # SmolLM2's template inserts its default system prompt when none is given.
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert text == tok.render_chat(MESSAGES)
    # Same ids as transformers' own tokenizer built from the GGUF, uncached.
    reference = tok.hf.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                           return_dict=False)
    assert ids == list(reference)
    without = tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert ids[:len(without)] == without
    assert tok.decode(ids[len(without):]) == "<|im_start|>assistant\n"


def test_system_message_replaces_default(smollm2_tokenizer):
    text = smollm2_tokenizer.decode(smollm2_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be terse."}] + MESSAGES))
    assert text.startswith("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n")


def test_special_ids(smollm2_tokenizer):
    tok = smollm2_tokenizer
    vocab = tok.hf.get_vocab()
    assert vocab["<|im_end|>"] == 2 and vocab["<|endoftext|>"] == 0
    assert tok.eos_token_ids == (0, 2)
    assert tok.pad_token_id == 2
    assert tok.vocab_size == 49152


def test_encode_decode_round_trip(smollm2_tokenizer):
    text = "Speculative decoding drafts tokens, then verifies them: 1234 ü ∑!"
    ids = smollm2_tokenizer.encode(text)
    assert ids == smollm2_tokenizer.encode(text, add_special_tokens=False)  # SmolLM2: no BOS
    assert smollm2_tokenizer.decode(ids) == text


def test_gguf_cache_is_equivalent_and_fast(smollm2_gguf_path, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_JAX_HOME", str(tmp_path))
    fresh = ChatTokenizer.from_gguf(smollm2_gguf_path)  # builds from GGUF metadata, then saves
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1
    start = time.perf_counter()
    cached = ChatTokenizer.from_gguf(smollm2_gguf_path)
    assert time.perf_counter() - start < 2.0  # ~0.25 s; the GGUF conversion takes ~4 s
    text = "Hello <|im_end|> world\n\n  x"
    assert cached.encode(text) == fresh.encode(text)
    assert cached.apply_chat_template(MESSAGES) == fresh.apply_chat_template(MESSAGES)
    assert cached.eos_token_ids == fresh.eos_token_ids


def test_errors(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        ChatTokenizer.from_gguf(tmp_path / "missing.gguf")
    with pytest.raises(TokenizerError, match="cannot load a tokenizer"):
        ChatTokenizer.from_hf_folder(tmp_path)


def test_works_without_torch(smollm2_gguf_path, smollm2_tokenizer, tmp_path):
    """torch is a test-only dependency: with it blocked, both the first build (transformers' GGUF
    reader imports torch, so we fall back to our own metadata reader) and the cached reload give
    the same ids as transformers' own tokenizer."""
    code = (
        "import sys, json; sys.modules['torch'] = None\n"
        "from eagle3_jax.text import ChatTokenizer\n"
        f"ids = [ChatTokenizer.from_gguf({str(smollm2_gguf_path)!r}).apply_chat_template("
        f"{MESSAGES!r}) for _ in range(2)]\n"  # first: uncached build, second: from the cache
        "print(json.dumps(ids))"
    )
    env = dict(os.environ, EAGLE3_JAX_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    want = smollm2_tokenizer.apply_chat_template(MESSAGES)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [want, want]


CONVERSATIONS = [
    MESSAGES,
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "1 <|im_end|> x"},
     {"role": "user", "content": "two\n\n  tabs\tand ünïcödé ∑ 🙂"}],
    [{"role": "user", "content": ""}],
]
TEXTS = ["", "Hello <|im_end|> world\n\n  x", "def f(x):\n    return x  # ∑ 🙂", " lead", "a" * 300]


def test_light_tokenizer_equals_transformers(smollm2_tokenizer):
    """The transformers-free path (encode, decode, chat template, special ids) gives what
    transformers' own tokenizer of the same folder gives."""
    tok = smollm2_tokenizer
    assert tok._light is not None  # the cached GGUF tokenizer folder is read without transformers
    hf = tok.hf
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt,
                                          return_dict=False)
            assert tok.apply_chat_template(messages, add_generation_prompt=prompt) == list(want)
            assert tok.render_chat(messages, prompt) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt)
    for text in TEXTS:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert tok.encode(text, add_special_tokens=special) == list(ids)
    ids = tok.apply_chat_template(CONVERSATIONS[2]) + [0, 2, 5, 1000, 49151]
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip)
    assert tok._light.eos_token_id == hf.eos_token_id
    assert tok._light.pad_token_id == hf.pad_token_id
    assert len(tok._light) == len(hf) and tok._light.get_vocab() == hf.get_vocab()


def test_decoding_start_does_not_import_transformers(smollm2_gguf_path, smollm2_tokenizer):
    """A cached tokenizer encodes, renders and decodes without importing transformers."""
    code = (
        "import sys\n"
        "from eagle3_jax.text import ChatTokenizer\n"
        f"tok = ChatTokenizer.from_gguf({str(smollm2_gguf_path)!r})\n"
        f"ids = tok.apply_chat_template({MESSAGES!r})\n"
        "print(tok.decode(ids), tok.eos_token_ids, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("(0, 2) False")
