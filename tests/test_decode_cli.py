"""The ``python -m eagle3_jax.decode`` CLI, through ``main(argv, load_fn=...)``.

Most tests inject a tiny random model with a byte-level tokenizer (ids 0-255 are bytes), so the
streamed text includes split and invalid UTF-8; one test runs the real default model.
"""

from __future__ import annotations

import json
import re
import types

import jax
import numpy as np
import pytest

from eagle3_jax.decode import main
from eagle3_jax.decoding import generate, pad_prompts
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import init_params, to_serving

EOS, PAD = 256, 257
CFG = TargetConfig(arch="llama", vocab_size=260, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   max_position_embeddings=128)


class ByteTokenizer:
    """Bytes as token ids, a plain-text chat template, EOS 256 and PAD 257."""

    eos_token_ids = (EOS,)
    pad_token_id = PAD

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return self.encode(text + ("assistant: " if add_generation_prompt else ""))


@pytest.fixture(scope="module")
def tiny():
    params = to_serving(init_params(CFG, jax.random.PRNGKey(1), scale=0.3), CFG)
    return types.SimpleNamespace(cfg=CFG, params=params, tokenizer=ByteTokenizer(),
                                 source="tiny-random")


def run(tiny, capsys, *argv):
    code = main(list(argv), load_fn=lambda target: tiny)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_lines_per_turn_with_history(tiny, capsys, tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = ['{"prompt": "hello"}', "", '{"turns": ["one", "two"]}', '{"prompt": "a longer one"}']
    path.write_text("\n".join(lines) + "\n")  # a blank line is skipped
    code, out, err = run(tiny, capsys, "--prompts-file", str(path), "--json",
                         "--max-new-tokens", "8", "--batch-size", "2")
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [(r["index"], r["turn"]) for r in records] == [(0, 0), (1, 0), (1, 1), (2, 0)]
    for r in records:
        assert set(r) >= {"prompt_token_ids", "token_ids", "text", "new_tokens", "seconds",
                          "tokens_per_s", "stop"}
        assert r["new_tokens"] == len(r["token_ids"]) <= 8 and EOS not in r["token_ids"]
        assert r["text"] == tiny.tokenizer.decode(r["token_ids"])
        assert r["seconds"] > 0 and r["tokens_per_s"] > 0
    # Greedy ids equal a direct batch-1 generate on the same prompt ids.
    for r in records:
        batch = pad_prompts([r["prompt_token_ids"]], pad_id=PAD, pad_batch=False)
        out1 = generate(tiny.params, CFG, batch.tokens, batch.lengths, max_new_tokens=8,
                        eos_token_ids=(EOS,))
        assert r["token_ids"] == np.asarray(out1.tokens[0, : int(out1.num_generated[0])]).tolist()
    # Turn 2 sees turn 1 and its answer.
    history = [{"role": "user", "content": "one"},
               {"role": "assistant", "content": records[1]["text"]},
               {"role": "user", "content": "two"}]
    assert records[2]["prompt_token_ids"] == tiny.tokenizer.apply_chat_template(history)
    # ... and its prefill started from turn 1's caches (at least turn 1's prompt); the greedy
    # ids above are still those of a prefill of the whole history.
    assert records[2]["reused_prompt_tokens"] >= len(records[1]["prompt_token_ids"])
    assert all("reused_prompt_tokens" not in r for r in records if r["turn"] == 0)


PLAIN_SUMMARY = re.compile(r"vanilla: (\d+\.\d) tokens/s")


def test_streamed_text_equals_json_text(tiny, capsys):
    """Streamed or as JSON, the answer is the same; either way stderr holds one summary line
    (the JSON's speed), and --verbose adds the diagnostics: the load, the prompt, the
    answer's timings."""
    code, out_json, err = run(tiny, capsys, "--prompt", "stream me", "--json",
                              "--max-new-tokens", "24")
    assert code == 0
    record = json.loads(out_json)
    (summary,) = err.splitlines()
    speed = PLAIN_SUMMARY.fullmatch(summary)
    assert speed and float(speed[1]) == pytest.approx(record["tokens_per_s"], abs=0.06)
    code, out_text, err = run(tiny, capsys, "--prompt", "stream me", "--max-new-tokens", "24")
    assert code == 0
    assert out_text == record["text"] + "\n"
    (summary,) = err.splitlines()
    assert PLAIN_SUMMARY.fullmatch(summary), err
    code, out_verbose, err = run(tiny, capsys, "--prompt", "stream me", "--max-new-tokens",
                                 "24", "--verbose")
    assert code == 0 and out_verbose == out_text
    lines = err.splitlines()
    assert lines[0].startswith("[loaded tiny-random") and "> stream me" in lines
    assert f"[{record['new_tokens']} tokens in " in err and PLAIN_SUMMARY.fullmatch(lines[-1])


def test_sampling_is_seeded(tiny, capsys):
    args = ("--prompt", "x", "--json", "--max-new-tokens", "16", "--temperature", "1.0",
            "--top-p", "0.9")
    ids = []
    for seed in ("1", "1", "2"):
        code, out, _ = run(tiny, capsys, *args, "--seed", seed)
        assert code == 0
        ids.append(json.loads(out)["token_ids"])
    assert ids[0] == ids[1] and ids[0] != ids[2]


@pytest.mark.parametrize("content,extra,message", [
    (None, (), "does not exist"),
    ('{"prompt": "ok"}\n{"prompt": oops}\n', (), "line 2 is not valid JSON"),
    ('{"prompt": "ok"}\n{"turns": []}\n', (), "line 2 must be"),
    ('{"prompt": "' + "long " * 40 + '"}\n', (), "tokens but the model context is 128"),
    ('{"prompt": "ok"}\n', ("--temperature", "-1"), "--temperature must be"),
    ('{"prompt": "ok"}\n', ("--top-p", "1.5"), "--top-p must be"),
    ('{"prompt": "ok"}\n', ("--top-k", "-2"), "--top-k must be"),
    ('{"prompt": "ok"}\n', ("--mesh", "tensor=x"), "--mesh takes AXIS=N"),
    ('{"turns": ["a", "b"]}\n', ("--raw",), "--raw takes single-turn prompts"),
    ('{"prompt": "ok"}\n', ("--max-new-tokens", "0"), "--max-new-tokens must be"),
])
def test_errors_are_one_clear_line(tiny, capsys, tmp_path, content, extra, message):
    path = tmp_path / "prompts.jsonl"
    if content is not None:
        path.write_text(content)
    code, out, err = run(tiny, capsys, "--prompts-file", str(path), "--json", *extra)
    assert code == 2 and out == ""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err


def test_system_prompt_raw_text_and_stop_strings(tiny, capsys):
    base = ("--prompt", "hi", "--json", "--max-new-tokens", "24")
    code, out, _ = run(tiny, capsys, *base, "--system", "be brief")
    assert code == 0
    record = json.loads(out)
    assert record["prompt_token_ids"] == tiny.tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    code, out, _ = run(tiny, capsys, *base, "--raw")
    assert json.loads(out)["prompt_token_ids"] == tiny.tokenizer.encode("hi")
    # A stop string taken from the plain answer: the answer ends just before it.
    code, out, _ = run(tiny, capsys, *base)
    full = json.loads(out)
    text = full["text"]
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2)
                if "\ufffd" not in text[i:i + 2] and text.find(text[i:i + 2]) == i)
    code, out, _ = run(tiny, capsys, *base, "--stop", stop)
    cut = json.loads(out)
    assert cut["stop"] == "stop" and cut["text"] == full["text"][:full["text"].find(stop)]
    assert cut["token_ids"] == full["token_ids"][:len(cut["token_ids"])]
    # Streamed, the same stop string prints the same text.
    code, streamed, _ = run(tiny, capsys, "--prompt", "hi", "--max-new-tokens", "24",
                            "--stop", stop)
    assert code == 0 and streamed == cut["text"] + "\n"


def test_chat_keeps_history_until_end_of_input(tiny, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("first\n\nsecond\n"))
    code, out, err = run(tiny, capsys, "--chat", "--max-new-tokens", "6", "--verbose")
    assert code == 0, err
    answers = out.splitlines()
    assert len(answers) == 2 and err.count("tokens in") == 2
    assert PLAIN_SUMMARY.fullmatch(err.splitlines()[-1])  # on leaving
    # The second turn's prefill started from the first turn's caches.
    assert err.count("prompt tokens from the turn before") == 1
    # The second turn is asked with the first turn and its answer as history.
    code, json_out, _ = run(tiny, capsys, "--json", "--max-new-tokens", "6", "--prompt", "first")
    assert answers[0] == json.loads(json_out)["text"]


@pytest.mark.parametrize("argv,message", [
    (("--batch-size", "4"), "--batch-size applies to --json and --compare"),
    (("--chat", "--json"), "--chat streams its answers"),
    (("--mode", "eagle", "--draft", "/nonexistent/head"), "draft head '/nonexistent/head' does not exist"),
    (("--depth", "3"), "--depth only apply to --mode eagle"),
    (("--draft", "/x", "--depth", "3", "--force-eagle"),
     "--force-eagle only applies to the auto tree"),
])
def test_bad_flags_fail_before_the_model_loads(capsys, argv, message):
    def must_not_load(target):
        raise AssertionError("the target was loaded")

    code = main(list(argv), load_fn=must_not_load)
    err = capsys.readouterr().err
    assert code == 2 and f"error: {message}" in err and "Traceback" not in err, err


def test_debug_shows_the_traceback(capsys):
    code = main(["--max-new-tokens", "0", "--debug"], load_fn=None)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err and "error: --max-new-tokens" in err


@pytest.mark.slow
def test_default_model_json(smollm2_gguf_path, capsys):
    code = main(["--max-new-tokens", "16", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    (line,) = captured.out.splitlines()
    record = json.loads(line)
    assert 1 <= record["new_tokens"] == len(record["token_ids"]) <= 16
    assert record["text"].strip() and record["tokens_per_s"] > 0
    assert record["prompt_token_ids"][-3:] and record["stop"] in ("eos", "length")
