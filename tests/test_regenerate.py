"""`regenerate`: assistant turns replaced by SmolLM2's own greedy answers, user turns kept,
resumable after an interruption (a cut-off last line included); the CLI and its errors."""

import json

import numpy as np
import pytest

from eagle3_jax.data import DataError, read_conversations, tokenize_conversation, write_jsonl
from eagle3_jax.data.__main__ import main
from eagle3_jax.data.regenerate import SHARD_GLOB, regenerate, regenerate_conversations
from eagle3_jax.decoding import generate, pad_prompts

N_NEW = 8
CONVERSATIONS = [
    {"id": "a", "conversations": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "ORIGINAL ANSWER A1"},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "ORIGINAL ANSWER A2"}]},
    {"id": "b", "conversations": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "ORIGINAL ANSWER B1"}]},
    {"id": "c", "conversations": [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "ORIGINAL ANSWER C1"},
        {"role": "user", "content": "A trailing user turn with no answer."}]},
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path):
    from eagle3_jax.checkpoints import load_target

    return load_target(str(smollm2_gguf_path))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(CONVERSATIONS, tmp_path_factory.mktemp("data") / "conversations.jsonl")


def greedy_answer(target, messages):
    """The target's greedy answer to ``messages`` by a separate, single-prompt generate call."""
    tok = target.tokenizer
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    batch = pad_prompts([prompt], pad_id=tok.pad_token_id)
    out = generate(target.params, target.cfg, batch.tokens, batch.lengths, max_new_tokens=N_NEW,
                   eos_token_ids=tok.eos_token_ids)
    return tok.decode(np.asarray(out.tokens[0, :int(out.num_generated[0])]))


def shard_lines(out):
    return [line for shard in sorted(out.glob(SHARD_GLOB))
            for line in shard.read_text().splitlines()]


def test_regenerate_resume_and_truncated_line(smollm2, data_file, tmp_path):
    out = tmp_path / "regen"
    first = regenerate(data_file, out, smollm2, limit=2, batch_size=2, max_new_tokens=N_NEW)
    assert (first.regenerated, first.already_done) == (2, 0)
    lines_before = shard_lines(out)
    # Shards hold conversations in the order they finished; conversations.jsonl in input order.
    assert sorted(json.loads(x)["id"] for x in lines_before) == ["a", "b"]
    # An interruption mid-write leaves a cut-off line for "c" behind.
    shard = sorted(out.glob(SHARD_GLOB))[-1]
    with open(shard, "a") as f:
        f.write('{"id": "c", "conversations": [{"role": "us')

    second = regenerate(data_file, out, smollm2, batch_size=2, max_new_tokens=N_NEW)
    assert (second.regenerated, second.already_done, second.skipped) == (1, 2, 0)
    lines_after = shard_lines(out)
    assert lines_after[:2] == lines_before  # a and b were not redone
    assert [json.loads(x)["id"] for x in lines_after][2:] == ["c"]

    # A third run finds everything done and generates nothing.
    third = regenerate(data_file, out, smollm2, batch_size=2, max_new_tokens=N_NEW)
    assert (third.regenerated, third.already_done, third.new_tokens) == (0, 3, 0)

    merged = {c["id"]: c for c in read_conversations(out)}  # conversations.jsonl, input order
    assert list(merged) == ["a", "b", "c"]
    for cid, original in zip("abc", CONVERSATIONS):
        got = merged[cid]
        assert got["regenerated_by"] == smollm2.source
        # User and system turns are kept; a trailing user turn without an answer is dropped.
        want_roles = [m["role"] for m in original["conversations"]]
        if want_roles[-1] == "user":
            want_roles.pop()
        assert [m["role"] for m in got["conversations"]] == want_roles
        so_far = []
        for m, o in zip(got["conversations"], original["conversations"]):
            if m["role"] == "assistant":
                # Each answer equals generate's greedy answer to the conversation so far, with
                # the earlier answers as regenerated.
                assert m["content"] == greedy_answer(smollm2, so_far), (cid, len(so_far))
                assert "ORIGINAL" not in m["content"]
            else:
                assert m == o
            so_far.append(m)
    # The output tokenises like any prepared conversation.
    ids, mask = tokenize_conversation(smollm2.tokenizer, merged["a"]["conversations"])
    assert mask.any()


def test_max_turns_and_long_prompts(smollm2, tmp_path):
    out = tmp_path / "regen"
    stats = regenerate_conversations(CONVERSATIONS, smollm2, out, batch_size=4,
                                     max_new_tokens=N_NEW, max_turns=1)
    assert stats.answers == 3
    got = {c["id"]: c for c in read_conversations(out)}
    assert [m["role"] for m in got["a"]["conversations"]] == ["user", "assistant"]

    # A prompt over max_prompt_len is not cut from the left: the conversation is skipped and
    # remembered as skipped, so a resumed run does not retry it.
    out2 = tmp_path / "short"
    stats = regenerate_conversations(CONVERSATIONS[1:2], smollm2, out2, max_new_tokens=N_NEW,
                                     max_prompt_len=16)
    assert (stats.regenerated, stats.skipped) == (0, 1)
    assert "max_prompt_len" in (out2 / "skipped.jsonl").read_text()
    again = regenerate_conversations(CONVERSATIONS[1:2], smollm2, out2, max_new_tokens=N_NEW,
                                     max_prompt_len=16)
    assert (again.skipped, again.already_done) == (0, 1)


def test_shortest_selects_by_opening_and_resumes_to_the_same_set(smollm2, tmp_path):
    """shortest=N answers the N conversations with the shortest system + first user turn
    (c: 10 characters, a: 30, b: 23 + 14): the same set however far an earlier run got."""
    out = tmp_path / "regen"
    first = regenerate_conversations(CONVERSATIONS, smollm2, out, max_new_tokens=N_NEW,
                                     max_turns=1, shortest=1)
    assert (first.requested, first.regenerated) == (1, 1)
    assert [c["id"] for c in read_conversations(out)] == ["c"]
    second = regenerate_conversations(CONVERSATIONS, smollm2, out, max_new_tokens=N_NEW,
                                      max_turns=1, shortest=2)
    assert (second.already_done, second.regenerated) == (1, 1)
    assert [c["id"] for c in read_conversations(out)] == ["a", "c"]  # merged, input order
    with pytest.raises(DataError, match="shortest must be >= 1"):
        regenerate_conversations(CONVERSATIONS, smollm2, out, shortest=0)


def test_cli_and_errors(smollm2, smollm2_gguf_path, data_file, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(["regenerate", "--data", str(data_file), "--out", str(out), "--target",
               str(smollm2_gguf_path), "--batch-size", "2", "--max-new-tokens", "4",
               "--limit", "1", "--max-turns", "1", "--temperature", "0.7", "--seed", "3"])
    assert rc == 0
    [record] = read_conversations(out)
    assert record["id"] == "a" and len(record["conversations"]) == 2

    assert main(["regenerate", "--data", str(tmp_path / "missing.jsonl"), "--out", str(out),
                 "--target", str(smollm2_gguf_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["regenerate", "--data", str(data_file), "--out", str(out), "--target",
                 str(tmp_path / "no-such-model")]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert main(["regenerate", "--data", str(data_file), "--out", str(out), "--target",
                 str(smollm2_gguf_path), "--top-p", "0"]) == 2
    assert "--top-p must be" in capsys.readouterr().err  # worded with the flag typed

    # A malformed line that is not the last one is an error, not silently dropped.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "regenerated-00000.jsonl").write_text('{"id": "a"\n{"id": "b"}\n')
    with pytest.raises(DataError, match="line 1 is malformed"):
        regenerate(data_file, bad, smollm2)
