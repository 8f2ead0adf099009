"""EAGLE mode of ``python -m eagle3_jax.decode`` and ``python -m eagle3_jax.bench speed``.

A random draft head (exported in the released format) accepts almost nothing, but greedy EAGLE
output must still equal plain greedy output token for token, which is what these tests pin:
on the real SmolLM2 through the CLI (batch 2, ``--compare``) and the library, and on a tiny
random target for streaming and a context that fills up. SmolLM2 compilations dominate the
time, so the CLI tests share one tree shape, one prompt set and one batch size.
"""

from __future__ import annotations

import json
import re
import statistics
import types

import jax
import numpy as np
import pytest

from eagle3_jax.decode import main
from eagle3_jax.decoding import generate, pad_prompts
from eagle3_jax.decoding.eagle import generate_eagle
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.export import export_draft_head
from eagle3_jax.draft.params import DraftHead, VocabMap, init_draft_params
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import init_params, to_serving

PROMPTS = ["What is the capital of France?",
           "List three prime numbers and explain briefly why each one is prime."]
TREE_ARGS = ("--tree-top-k", "2", "--depth", "3", "--total-tokens", "8")


def random_head(cfg: TargetConfig, draft_vocab: int, seed: int = 0, **overrides) -> DraftHead:
    dcfg = DraftConfig.for_target(cfg, draft_vocab_size=draft_vocab, **overrides)
    used = np.sort(np.random.default_rng(seed).choice(cfg.vocab_size, draft_vocab, replace=False))
    return DraftHead(params=init_draft_params(dcfg, jax.random.key(seed), scale=0.05),
                     vocab=VocabMap.from_used_ids(used, cfg.vocab_size), cfg=dcfg)


def zero_head(cfg: TargetConfig, draft_vocab: int, **overrides) -> DraftHead:
    """A head of zero weights, for what depends on the config alone (drawing random weights
    compiles a sampler per shape)."""
    dcfg = DraftConfig.for_target(cfg, draft_vocab_size=draft_vocab, **overrides)
    shapes = jax.eval_shape(lambda: init_draft_params(dcfg, jax.random.key(0)))
    return DraftHead(params=jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes),
                     vocab=VocabMap.from_used_ids(np.arange(draft_vocab), cfg.vocab_size),
                     cfg=dcfg)


def run(target, capsys, *argv):
    code = main(list(argv), load_fn=lambda _: target)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error(code, out, err, message):
    assert code == 2 and out == "", err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err


# ---------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2(smollm2_target):
    """The default target (the session's one read of it)."""
    return smollm2_target


@pytest.fixture(scope="module")
def smollm2_head_dir(smollm2, tmp_path_factory):
    return export_draft_head(random_head(smollm2.cfg, 2048),
                             tmp_path_factory.mktemp("heads") / "smollm2-random")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


@pytest.mark.slow
def test_eagle_json_equals_vanilla(smollm2, smollm2_head_dir, prompts_file, capsys):
    common = ("--prompts-file", str(prompts_file), "--json", "--max-new-tokens", "24",
              "--batch-size", "2")
    code, out, err = run(smollm2, capsys, *common)
    assert code == 0, err
    plain = [json.loads(line) for line in out.splitlines()]
    code, out, err = run(smollm2, capsys, *common, "--mode", "eagle", "--draft",
                         str(smollm2_head_dir), *TREE_ARGS)
    assert code == 0, err
    spec = [json.loads(line) for line in out.splitlines()]
    assert len(spec) == len(plain) == 2
    for p, s in zip(plain, spec):
        assert s["token_ids"] == p["token_ids"] and s["text"] == p["text"]
        assert s["stop"] == p["stop"] and s["stop"] in ("eos", "length")
        assert "rounds" not in p
        hist = s["accept_hist"]
        assert len(hist) == 3 + 2 and sum(hist) == s["rounds"] >= 1
        # Tokens per round: the prefill's token is not a round, and a round counts what it
        # emitted (no EOS, nothing past --max-new-tokens), so the rounds sum to new_tokens - 1.
        per_round = sum(j * n for j, n in enumerate(hist)) / s["rounds"]
        assert s["mean_accept_length"] == pytest.approx(per_round, abs=1e-3)
        assert s["new_tokens"] - 1 == sum(j * n for j, n in enumerate(hist))
    assert [s["batch_size"] for s in spec] == [2, 2]


@pytest.mark.slow
def test_compare_reports_both_speeds(smollm2, smollm2_head_dir, prompts_file, capsys):
    code, out, err = run(smollm2, capsys, "--prompts-file", str(prompts_file), "--compare",
                         "--max-new-tokens", "24", "--batch-size", "2", "--draft",
                         str(smollm2_head_dir), *TREE_ARGS)
    assert code == 0, err
    # Each answer after its prompt, then one summary line; no diagnostics without --verbose.
    lines = err.splitlines()
    assert lines[:-1] == [f"> {p}" for p in PROMPTS]
    assert lines[-1].startswith("eagle (tree: top-k 2, depth 3, 8 tokens): tau ")
    assert "tokens/s; plain " in lines[-1] and lines[-1].endswith("x, outputs identical")
    assert "compare:" not in out


@pytest.mark.slow
@pytest.mark.parametrize("tree", [TreeConfig.chain(4), TreeConfig(tree_top_k=2, depth=3,
                                                                  total_tokens=8)],
                         ids=["chain", "tree"])
def test_library_greedy_equals_plain_on_smollm2(smollm2, smollm2_head_dir, tree):
    """``generate_eagle`` against ``generate`` on the two prompts of different lengths in one
    padded batch, with the CLI tests' head, token budget and EOS ids: their plain program and
    the tree's (the CLI's 2/3/8) are the ones the CLI tests compiled."""
    from eagle3_jax.draft.load import load_head

    tok = smollm2.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    assert len(ids[0]) != len(ids[1])
    batch = pad_prompts(ids, pad_id=tok.pad_token_id)
    head = load_head(smollm2_head_dir, smollm2.cfg).head
    common = dict(max_new_tokens=24, eos_token_ids=tok.eos_token_ids)
    plain = generate(smollm2.params, smollm2.cfg, batch.tokens, batch.lengths, **common)
    out = generate_eagle(smollm2.params, smollm2.cfg, head, batch.tokens, batch.lengths,
                         tree=tree, **common)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.num_generated, plain.num_generated)
    assert (np.asarray(out.rounds) >= 1).all()


@pytest.mark.slow
def test_errors_are_one_clear_line(smollm2, smollm2_head_dir, tmp_path, capsys):
    narrow = zero_head(smollm2.cfg, 256, hidden_size=64, intermediate_size=128, num_heads=2,
                       num_kv_heads=1, head_dim=32)
    misfit = export_draft_head(narrow, tmp_path / "narrow")
    cases = [
        (("--draft", str(misfit)), "hidden size 64 != target's 576"),
        (("--draft", str(smollm2_head_dir), "--tree-top-k", "1", "--depth", "2",
          "--total-tokens", "10"), "total_tokens <= 3"),
        (("--mode", "eagle"), "this target has no shipped one"),
        (("--draft", str(tmp_path / "nope")), "does not exist"),
        (("--draft", str(tmp_path)), "neither a released EAGLE-3 head folder"),
        (("--mode", "vanilla", "--depth", "3"), "only apply to --mode eagle"),
    ]
    for extra, message in cases:
        one_error(*run(smollm2, capsys, "--prompt", "hi", "--json", *extra), message)


# ---------------------------------------------------------------------------- tiny target

EOS, PAD = 256, 257
TINY = TargetConfig(arch="llama", vocab_size=260, hidden_size=32, intermediate_size=64,
                    num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                    max_position_embeddings=128)


class ByteTokenizer:
    eos_token_ids = (EOS,)
    pad_token_id = PAD

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return list((text + ("assistant: " if add_generation_prompt else "")).encode())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target = types.SimpleNamespace(cfg=TINY, params=to_serving(
                                       init_params(TINY, jax.random.key(1), scale=0.3), TINY),
                                   tokenizer=ByteTokenizer(), source="tiny-random")
    head_dir = export_draft_head(random_head(TINY, 200, seed=2),
                                 tmp_path_factory.mktemp("tiny") / "head")
    return target, str(head_dir)


def test_streamed_eagle_text_equals_vanilla(tiny, capsys):
    target, head = tiny
    # 40 tokens, as the auto-tree tests below: the plain stream's programs are compiled once.
    _, plain, _ = run(target, capsys, "--prompt", "stream me", "--max-new-tokens", "40")
    code, spec, err = run(target, capsys, "--prompt", "stream me", "--max-new-tokens", "40",
                          "--draft", head, "--tree-top-k", "2", "--depth", "2")
    assert code == 0, err
    assert spec == plain
    # The tree the flags give (every candidate of the shape: 2 + 4 + the root), no fallback.
    (summary,) = err.splitlines()
    assert re.fullmatch(r"eagle \(tree: top-k 2, depth 2, 7 tokens\): tau \d\.\d\d, "
                        r"\d+\.\d tokens/s", summary), summary


class NoEosTokenizer(ByteTokenizer):
    eos_token_ids = ()  # the random model must run into the context, not stop early


def test_full_context_stops_cleanly(tiny, capsys):
    target, head = tiny
    target = types.SimpleNamespace(**{**vars(target), "tokenizer": NoEosTokenizer()})
    args = ("--prompt", "x" * 40, "--json", "--max-new-tokens", "120")
    code, out, err = run(target, capsys, *args)
    assert code == 0, err
    plain = json.loads(out)
    code, out, err = run(target, capsys, *args, "--draft", head, *TREE_ARGS)
    assert code == 0, err
    spec = json.loads(out)
    assert plain["stop"] == spec["stop"] == "context"
    n = spec["new_tokens"]
    assert 0 < n < plain["new_tokens"] < 120 and spec["token_ids"] == plain["token_ids"][:n]
    prompt = len(plain["prompt_token_ids"])
    # Plain decoding fills every slot, then emits the token it could not feed back.
    assert prompt + plain["new_tokens"] == TINY.max_position_embeddings + 1
    # EAGLE stops once the next 8-token tree (+ depth + 1 slack) would not fit.
    assert prompt + n - 1 + 8 + 4 > TINY.max_position_embeddings


# The speed benchmark tests' answer length: one for all, so they share the decoders' compiled
# programs (the length is static in them); 9 is what the ceiling test's arithmetic needs.
SPEED_TOKENS = "9"


def _bench_target_and_head(tmp_path):
    """A tiny random target (as ``load_fn`` hands the bench) and a random head's folder."""
    cfg = TargetConfig(**{**TINY.to_dict(), "max_position_embeddings": 1024})
    target = types.SimpleNamespace(cfg=cfg, params=to_serving(
                                       init_params(cfg, jax.random.key(3), scale=0.3), cfg),
                                   tokenizer=ByteTokenizer(), source="tiny-random")
    return target, export_draft_head(random_head(cfg, 200, seed=4), tmp_path / "head")


def test_bench_speed_json(tmp_path, capsys):
    """The speed benchmark's plumbing on a tiny random target (SmolLM2 runs above cover the real
    model): JSON shape, both modes identical, two MT-bench turns (the second from the first's
    caches), table and plot written."""
    from eagle3_jax.bench.speed import main as speed_main

    target, head = _bench_target_and_head(tmp_path)
    out = tmp_path / "speed.json"
    code = speed_main(["--tasks", "mt_bench,gsm8k", "--num-prompts", "1", "--max-new-tokens",
                       SPEED_TOKENS, "--draft", str(head), "--out", str(out), "--reuse-prefix",
                       *TREE_ARGS],
                      load_fn=lambda _: target)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(out.read_text())
    assert set(result["tasks"]) == {"mt_bench", "gsm8k"}
    for task in result["tasks"].values():
        assert {"tau", "accept_by_depth", "tokens_per_s_vanilla", "tokens_per_s_eagle",
                "speedup"} <= set(task)
        assert len(task["accept_by_depth"]) == 3 and task["tau"] >= 1
        assert task["identical"] is True and task["tokens_per_s_eagle"] > 0
    assert result["tasks"]["mt_bench"]["turns"] == 2
    # Per-turn records: the totals are their sums, the speeds their medians, turn numbers kept.
    for task in result["tasks"].values():
        turns = task["per_turn"]
        assert len(turns) == task["turns"]
        assert sum(t["new_tokens"] for t in turns) == task["new_tokens"]
        assert sum(t["rounds"] for t in turns) == task["rounds"]
        eagle = [t["new_tokens"] / t["seconds_eagle"] for t in turns]
        assert task["tokens_per_s_eagle"] == pytest.approx(statistics.median(eagle))
        assert task["tau_median_turn"] == pytest.approx(statistics.median(t["tau"] for t in turns))
    mt_turns = result["tasks"]["mt_bench"]["per_turn"]
    assert [t["turn"] for t in mt_turns] == [1, 2]
    assert set(result["tasks"]["mt_bench"]["speedup_by_turn"]) == {"1", "2"}
    # --reuse-prefix: MT-bench's turn 2 started from turn 1's caches; one-turn GSM8K cannot.
    mt = result["tasks"]["mt_bench"]
    assert mt["prompt_tokens"] > mt["reused_prompt_tokens_eagle"] > 0
    assert result["tasks"]["gsm8k"]["reused_prompt_tokens_eagle"] == 0
    assert result["config"]["reuse_prefix"] is True
    assert result["config"]["tree"] == {"tree_top_k": 2, "depth": 3, "total_tokens": 8}
    assert result["config"]["fallback"] is False  # a fixed tree: as the decoder, no fallback
    assert "| mt_bench |" in captured.out
    assert out.with_suffix(".md").is_file() and out.with_suffix(".png").stat().st_size > 0


def test_bench_speed_ceiling_is_the_targets_own_chain_at_temperature_0(tmp_path, capsys):
    """``--ceiling``: the target drafts for itself, so a greedy round accepts the whole depth
    (a turn of 1 + 2 (depth + 1) tokens takes 2 rounds), the output is plain decoding's, and
    it refuses --fallback in one line."""
    from eagle3_jax.bench.speed import main as speed_main

    target, head = _bench_target_and_head(tmp_path)
    out = tmp_path / "ceiling.json"
    args = ["--tasks", "mt_bench,gsm8k", "--num-prompts", "1", "--max-new-tokens", SPEED_TOKENS,
            "--draft", str(head), "--out", str(out), "--no-plot", *TREE_ARGS]
    code = speed_main([*args, "--ceiling"], load_fn=lambda _: target)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(out.read_text())
    assert result["config"]["ceiling"] is True and "drafting for itself" in result["config"]["draft"]
    turns = [t for task in result["tasks"].values() for t in task["per_turn"]]
    assert all(task["identical"] for task in result["tasks"].values())
    full = [t for t in turns if t["new_tokens"] == int(SPEED_TOKENS)]  # no EOS before the end
    assert full and all(t["rounds"] == 2 and t["tau"] == 4.0 for t in full), turns
    code = speed_main([*args, "--ceiling", "--fallback"], load_fn=lambda _: target)
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "--ceiling" in err[0]


def test_bench_speed_resumes_where_a_run_stopped(tmp_path, capsys):
    """Every conversation's records go to OUT.turns.jsonl as it finishes; ``--resume`` reads
    back those measured with the same settings (past a line a kill cut short) and decodes only
    the rest, here a run extended from 1 to 2 prompts a task; other settings are refused in
    one line."""
    from eagle3_jax.bench.speed import main as speed_main

    target, head = _bench_target_and_head(tmp_path)
    out = tmp_path / "speed.json"
    args = ["--tasks", "mt_bench,gsm8k", "--max-new-tokens", SPEED_TOKENS, "--draft", str(head),
            "--out", str(out), "--no-plot", *TREE_ARGS]
    assert speed_main([*args, "--num-prompts", "1"], load_fn=lambda _: target) == 0
    first = json.loads(out.read_text())
    turns = out.with_suffix(".turns.jsonl")
    turns.write_text(turns.read_text() + '{"task": "gsm8k", "ind')  # killed mid-line
    capsys.readouterr()
    assert speed_main([*args, "--num-prompts", "2", "--resume"], load_fn=lambda _: target) == 0
    # Decoded now: MT-bench's second conversation (2 turns) and GSM8K's second question.
    assert capsys.readouterr().err.count(" prompt tokens: ") == 3
    second = json.loads(out.read_text())
    for task in ("mt_bench", "gsm8k"):
        before, after = first["tasks"][task]["per_turn"], second["tasks"][task]["per_turn"]
        assert after[:len(before)] == before and len(after) == 2 * len(before)
        assert second["tasks"][task]["prompts"] == 2
        assert second["tasks"][task]["rounds"] == sum(t["rounds"] for t in after)
    assert second["config"]["conversations_resumed"] == 2
    assert len(turns.read_text().splitlines()) == 1 + 4  # the settings, 4 conversations
    code = speed_main([*args, "--num-prompts", "2", "--resume", "--temperature", "1"],
                      load_fn=lambda _: target)
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "temperature" in err[0] and "--resume" in err[0]
    # Without --resume a run starts afresh, and the records it replaces are kept once.
    kept = turns.read_text()
    assert speed_main([*args, "--num-prompts", "1"], load_fn=lambda _: target) == 0
    assert turns.with_name(turns.name + ".old").read_text() == kept
    assert len(turns.read_text().splitlines()) == 1 + 2


def test_bench_speed_times_hf_transformers_beside(tmp_path, capsys, monkeypatch):
    """--hf times HF's greedy generate on every prompt beside ours (here a stand-in model that
    answers with 5 fixed tokens: the plumbing, not the speed) and reports the ratio."""
    import torch

    from eagle3_jax.bench import forward as bench_forward
    from eagle3_jax.bench.speed import main as speed_main

    calls = []

    class FakeHF:
        def generate(self, input_ids, **kw):
            calls.append((input_ids.shape[1], kw["max_new_tokens"], kw["do_sample"]))
            return torch.cat([input_ids, torch.full((1, 5), 65)], dim=1)

    monkeypatch.setattr(bench_forward, "load_hf_reference", lambda path: FakeHF())
    cfg = TargetConfig(**{**TINY.to_dict(), "max_position_embeddings": 1024})
    target = types.SimpleNamespace(cfg=cfg, params=to_serving(
                                       init_params(cfg, jax.random.key(3), scale=0.3), cfg),
                                   tokenizer=ByteTokenizer(), source="tiny-random",
                                   weights=tmp_path / "model.gguf")
    head = export_draft_head(random_head(cfg, 200, seed=4), tmp_path / "head")
    out = tmp_path / "speed.json"
    code = speed_main(["--tasks", "gsm8k", "--num-prompts", "2", "--max-new-tokens", SPEED_TOKENS,
                       "--draft", str(head), "--out", str(out), "--hf", "--no-plot",
                       *TREE_ARGS], load_fn=lambda _: target)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    row = json.loads(out.read_text())["tasks"]["gsm8k"]
    assert len(calls) == 2 and all(c[1:] == (int(SPEED_TOKENS), False) for c in calls)
    assert row["tokens_per_s_hf"] > 0
    assert row["speedup_vs_hf"] == pytest.approx(row["tokens_per_s_eagle"] / row["tokens_per_s_hf"])
    assert "eagle vs HF" in captured.out


@pytest.fixture
def steady_costs(monkeypatch, tmp_path):
    """The tree chooser's timings replaced by fixed costs, cached in a temporary directory, so
    the CLI's choice does not hang on the machine: on the tiny model a round costs a few of its
    plain steps, near break-even, and a CI machine once found no tree paying at batch 2 (the
    timings are what the chooser's own tests measure). A target forward of T tokens costs
    1 + T/64 ms, a draft step 0.1 ms (drafting pays at the claimed acceptance), a whole round
    1.5 plain steps (a random head's ~1 token a round does not). Returns the batches each kind
    of cost was asked for."""
    from eagle3_jax.decoding import autotune

    asked = {"target": [], "draft": [], "round": []}

    def forward_curve(params, cfg, context, sizes, repeats, batch=1):
        asked["target"].append(batch)
        return {t: 1e-3 * (1 + t / 64) for t in sizes}

    def measure_draft_steps(head, embed, context, widths, repeats, batch=1):
        asked["draft"].append(batch)
        return {w: 1e-4 for w in widths}

    def measure_round(params, cfg, head, trees, context, repeats, batch=1):
        asked["round"].append(batch)
        return [{"round": 1.5e-3, "step": 1e-3} for _ in trees]

    monkeypatch.setattr(autotune, "forward_curve", forward_curve)
    monkeypatch.setattr(autotune, "measure_draft_steps", measure_draft_steps)
    monkeypatch.setattr(autotune, "measure_round", measure_round)
    monkeypatch.setattr(autotune, "cache_root", lambda: tmp_path / "autotune")
    return asked


def test_auto_tree_gives_up_drafting_where_it_does_not_pay(tiny, capsys, steady_costs):
    """The chooser believes the head's (claimed) acceptance and drafts; the random head accepts
    almost nothing on the prompt itself, so after the probe rounds the decoder gives up and
    decodes plainly, with the same text as plain decoding. ``--force-eagle`` drafts to the end.
    ``--verbose`` shows the chooser's and the fallback's diagnostics."""
    target, head = tiny
    _, plain, _ = run(target, capsys, "--prompt", "give up", "--max-new-tokens", "40")
    auto = ("--prompt", "give up", "--max-new-tokens", "40", "--draft", head, "--total-tokens",
            "auto", "--accept-rates", ",".join(["0.95"] * 8), "--verbose")
    code, spec, err = run(target, capsys, *auto)
    assert code == 0, err
    assert spec == plain
    assert "[fallback: at a 128-token context a round takes 1.5 ms and a plain step 1.0 ms" in err
    assert steady_costs == {"target": [1], "draft": [1], "round": [1]}
    assert "plain decode steps where drafting did not pay" in err
    assert "8 rounds, mean accept length" in err
    assert "[autotune (--accept-rates acceptance rates): tree_top_k=" in err
    assert err.splitlines()[-1].endswith("; gave up drafting where it did not pay on 1/1 "
                                         "answers")
    code, forced, err = run(target, capsys, *auto, "--force-eagle")
    assert code == 0 and forced == plain, err
    assert "[fallback:" not in err and "plain decode steps" not in err


def test_a_draft_without_tree_flags_gets_the_auto_tree_and_the_fallback(tiny, capsys,
                                                                       steady_costs):
    """``--draft`` without tree flags decodes as the shipped head does: the tree chosen for
    this machine, with the fallback. This head was exported with no acceptance record, so the
    chooser models the default rates and the summary line says so; the fallback then finds
    the random head's acceptance too low and decodes plainly. Without --verbose, stderr is that
    one line."""
    from eagle3_jax.draft.load import load_head

    target, head = tiny
    assert load_head(head).accept_rates is None
    _, plain, _ = run(target, capsys, "--prompt", "give up", "--max-new-tokens", "40")
    code, out, err = run(target, capsys, "--prompt", "give up", "--max-new-tokens", "40",
                         "--draft", head)
    assert code == 0, err
    assert out == plain
    (summary,) = err.splitlines()
    assert re.fullmatch(
        r"eagle \(tree: top-k \d+, depth \d, \d+ tokens, chosen for this machine at the "
        r"default acceptance rates 0\.6\*0\.9\^d \(the head has no acceptance record\)\): "
        r"tau \d\.\d\d, \d+\.\d tokens/s; gave up drafting where it did not pay on 1/1 "
        r"answers", summary), summary
    assert steady_costs == {"target": [1], "draft": [1], "round": [1]}


def test_auto_tree_at_batch_two_measures_that_batch(tiny, tmp_path, capsys, steady_costs):
    """--json decodes prompts in batches: the costs (and so the break-even) are the padded
    batch's, and the JSON says how many plain steps each answer took after giving up."""
    target, head = tiny
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("one", "two two")))
    common = ("--prompts-file", str(path), "--json", "--max-new-tokens", "40")
    _, plain, _ = run(target, capsys, *common)
    code, out, err = run(target, capsys, *common, "--draft", head, "--total-tokens", "auto",
                         "--accept-rates", ",".join(["0.95"] * 8), "--verbose")
    assert code == 0, err
    assert "context and 2 rows a round takes 1.5 ms and a plain step 1.0 ms" in err
    assert steady_costs == {"target": [2], "draft": [2], "round": [2]}
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["token_ids"] for r in records] == [json.loads(line)["token_ids"]
                                                 for line in plain.splitlines()]
    assert all(r["rounds"] == 8 and r["plain_steps"] > 0 for r in records)
