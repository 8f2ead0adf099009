"""Shipped draft heads: which target has one (``eagle3_jax.draft.shipped``), EAGLE as the
decoder's default for it, the shipped head's files, and export writing acceptance.json and a
model card from a training run's records."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from eagle3_jax.draft import shipped
from eagle3_jax.draft.export import export_draft_head
from eagle3_jax.presets import PresetError, load_preset, preset_path
from test_eagle_cli import TINY, ByteTokenizer, random_head


def test_the_default_preset_names_its_head_and_only_presets_get_one(tmp_path, monkeypatch):
    assert load_preset("smollm2-135m").draft_head == "builtin:smollm2-135m"
    assert load_preset("llama-3.1-8b-instruct").draft_head is None
    heads = tmp_path / "heads"
    monkeypatch.setattr(shipped, "HEADS_DIR", heads)
    assert shipped.shipped_head_for(None) is None  # named, but absent from this install
    (heads / "smollm2-135m").mkdir(parents=True)
    (heads / "smollm2-135m" / "config.json").write_text("{}")
    assert shipped.shipped_head_for(None) == heads / "smollm2-135m"
    assert shipped.shipped_head_for("smollm2-135m") == heads / "smollm2-135m"
    assert shipped.shipped_head_for("llama-3.1-8b-instruct") is None  # no head named
    assert shipped.shipped_head_for("no-such-preset") is None
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    assert shipped.shipped_head_for(str(gguf)) is None  # a path: not the preset's weights


def test_a_preset_head_must_be_builtin(tmp_path):
    text = Path(str(preset_path("smollm2-135m"))).read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("draft_head: builtin:smollm2-135m", "draft_head: /some/dir"))
    with pytest.raises(PresetError, match="draft_head must be null or 'builtin:NAME'"):
        load_preset(bad)


def test_a_target_with_a_shipped_head_decodes_with_eagle_by_default(capsys, tmp_path):
    target, head = _tiny(tmp_path)
    has_head = lambda _: Path(head)  # noqa: E731
    args = ["--prompt", "hello there", "--json", "--max-new-tokens", "12"]
    from eagle3_jax.decode import main

    code = main([*args, "--tree-top-k", "2", "--depth", "2"], load_fn=lambda _: target,
                head_for=has_head)
    out, err = capsys.readouterr()
    assert code == 0, err
    spec = json.loads(out)
    assert err.startswith("eagle (tree: top-k 2, depth 2, 7 tokens): tau ")
    assert spec["rounds"] >= 1
    code = main([*args, "--mode", "vanilla"], load_fn=lambda _: target, head_for=has_head)
    out, err = capsys.readouterr()
    plain = json.loads(out)
    assert code == 0 and err.startswith("vanilla: ") and "rounds" not in plain
    assert plain["token_ids"] == spec["token_ids"]  # greedy EAGLE is lossless
    # No shipped head: tree flags still need --draft.
    code = main([*args, "--depth", "2"], load_fn=lambda _: target, head_for=lambda _: None)
    assert code == 2 and "only apply to --mode eagle" in capsys.readouterr().err


def _tiny(tmp_path):
    """The tiny random target of test_eagle_cli and a random head for it."""
    import types

    from eagle3_jax.model.params import init_params, to_serving

    target = types.SimpleNamespace(cfg=TINY, params=to_serving(
        init_params(TINY, jax.random.key(1), scale=0.3), TINY), tokenizer=ByteTokenizer(),
        source="tiny-random")
    return target, str(export_draft_head(random_head(TINY, 200, seed=2), tmp_path / "head"))


def test_the_shipped_head_is_16_bit_small_and_measured():
    """The head in the package: released layout, stored in 16-bit under 25 MB, loaded in the
    target's dtype, with the per-depth hit rates the tree chooser reads, and its card."""
    from eagle3_jax.draft.load import load_head

    folder = shipped.shipped_head_for(None)
    if folder is None:
        pytest.skip("this install ships no head for the default target")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["torch_dtype"] in ("bfloat16", "float16")
    assert (folder / "model.safetensors").stat().st_size < 25 * 2**20
    loaded = load_head(folder, load_preset("smollm2-135m").target)
    assert all(v.dtype == np.float32 for v in loaded.head.params.values())
    rates = loaded.accept_rates
    assert rates and all(len(r) >= 4 and r == sorted(r) for r in rates)
    card = (folder / "README.md").read_text()
    assert "make head" in card and "Held-out accuracy by depth" in card


def test_the_shipped_head_carries_its_live_calibration():
    """``acceptance.json``'s ``"live"`` (``bench calibrate --write``): per tree the modelled tau
    the chooser computes from the file's own rates, a live tau below it, and their pooled
    scale; ``load_head`` hands the chooser their per-level fit."""
    from eagle3_jax.decoding.acceptance import expected_accept_length
    from eagle3_jax.decoding.calibration import accept_scale, fit_live_scale
    from eagle3_jax.decoding.tree import TreeConfig
    from eagle3_jax.draft.load import load_head, rates_of

    folder = shipped.shipped_head_for(None)
    if folder is None:
        pytest.skip("this install ships no head for the default target")
    record = json.loads((folder / "acceptance.json").read_text())
    live = record["live"]
    assert len(live["trees"]) >= 3 and live["prompts"]["count"] >= 16
    for tree in live["trees"]:
        shape = TreeConfig(tree_top_k=tree["tree_top_k"], depth=tree["depth"],
                           total_tokens=tree["total_tokens"])
        assert tree["modelled_tau"] == pytest.approx(
            expected_accept_length(shape, rates_of(record)))
        assert 1.0 < tree["live_tau"] < tree["modelled_tau"] and tree["rounds"] > 100
    assert 0 < live["scale"] < 1 and live["scale"] == pytest.approx(accept_scale(live["trees"]))
    from eagle3_jax.draft.export import weights_digest
    assert live["weights_sha256"] == weights_digest(folder)  # measured on these very weights
    loaded = load_head(folder, load_preset("smollm2-135m").target)
    # The chooser's calibration: the per-level fit of the same trees; deeper levels lose more.
    assert (loaded.accept_scale, loaded.accept_decay) == pytest.approx(
        fit_live_scale(live["trees"], rates_of(record)))
    assert loaded.accept_decay < 1


def test_export_writes_acceptance_and_a_card_from_the_run(tmp_path):
    from eagle3_jax.draft.load import load_head
    from eagle3_jax.export import main
    from test_export import train_tiny_run

    run_dir = tmp_path / "run"
    tcfg = train_tiny_run(run_dir, num_records=24, eval_every=2, eval_batches=1,
                          eval_fraction=0.3, log_every=1)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert train_rows[-1]["tokens"] > train_rows[0]["tokens"] > 0
    assert train_rows[-1]["seconds"] >= train_rows[0]["seconds"] >= 0
    (ev,) = [r for r in rows if r["kind"] == "eval"]
    assert np.asarray(ev["hits_per_step"]).shape == (2, 10)
    build = tmp_path / "build.json"
    build.write_text(json.dumps({"data": ["ten random rows"], "command": "make head"}))
    out = tmp_path / "head"
    assert main(["--checkpoint", str(run_dir), "--out", str(out), "--dtype", "bfloat16",
                 "--card", "A test head", "--build-info", str(build)]) == 0
    acceptance = json.loads((out / "acceptance.json").read_text())
    assert acceptance["hits_per_step"] == ev["hits_per_step"] and acceptance["step"] == 2
    loaded = load_head(out, tcfg)
    assert loaded.accept_rates == ev["hits_per_step"]
    assert all(v.dtype == np.float32 for v in loaded.head.params.values())  # the target's
    card = (out / "README.md").read_text()
    assert card.startswith("# A test head") and "ten random rows" in card
    assert "| depth | top-1 | top-2 | top-4 | top-10 |" in card and "make head" in card
    # A live calibration (`bench calibrate --write`) survives re-exporting the same weights,
    # and is dropped for other weights.
    from eagle3_jax.draft.export import weights_digest
    live = {"scale": 0.5, "weights_sha256": weights_digest(out), "max_new_tokens": 9,
            "trees": [{"tree_top_k": 2, "depth": 3, "total_tokens": 4, "modelled_tau": 2.5,
                       "live_tau": 1.75, "rounds": 77}],
            "prompts": {"source": "some prompts", "min_chars": 1, "max_chars": 2, "count": 3}}
    (out / "acceptance.json").write_text(json.dumps({**acceptance, "live": live}))
    export = ["--checkpoint", str(run_dir), "--out", str(out)]
    assert main([*export, "--dtype", "bfloat16", "--card", "Again"]) == 0
    assert json.loads((out / "acceptance.json").read_text())["live"] == live
    assert load_head(out, tcfg).accept_scale == 0.5
    card = (out / "README.md").read_text()
    assert "**0.500**" in card and "| 2/3/4 | 2.500 | 1.750 | 77 |" in card
    assert main([*export, "--dtype", "float32"]) == 0
    assert "live" not in json.loads((out / "acceptance.json").read_text())
    assert load_head(out, tcfg).accept_scale is None


def test_a_new_run_starts_from_a_committed_head(tmp_path):
    """init_head: a new run's weights and vocabulary are the head's (one step in warm-up, whose
    first learning rate is 0, leaves them as they were); a resumed run keeps its own; a head of
    another target is refused in one line."""
    from eagle3_jax.draft.load import read_run_head
    from eagle3_jax.model.config import ConfigError
    from eagle3_jax.model.params import init_params
    from eagle3_jax.train.config import OptimizerConfig, TrainConfig
    from eagle3_jax.train.loop import TargetOverride, train
    from test_export import VD, V, target_cfg

    tcfg = target_cfg()
    override = TargetOverride(tcfg, init_params(tcfg, jax.random.key(0)))
    rng = np.random.default_rng(0)
    records = [{"input_ids": rng.integers(0, V, 20).astype(np.int32),
                "loss_mask": np.ones(20, bool)} for _ in range(16)]
    common = dict(target="tiny", max_len=16, batch_size=8, ttt_steps=2, draft_vocab_size=VD,
                  save_every=1, eval_batches=0, progress=False)
    first = tmp_path / "first"
    train(TrainConfig(out_dir=str(first), total_steps=2, **common), target_override=override,
          train_records=records)
    head, _ = read_run_head(first)
    folder = export_draft_head(head, tmp_path / "head")
    second = tmp_path / "second"
    cfg = TrainConfig(out_dir=str(second), total_steps=1, init_head=str(folder), seed=5,
                      optimizer=OptimizerConfig(warmup_steps=5), **common)
    train(cfg, target_override=override, train_records=records)
    started, _ = read_run_head(second)
    for name, value in head.params.items():
        np.testing.assert_array_equal(started.params[name], value, err_msg=name)
    np.testing.assert_array_equal(started.vocab.t2d, head.vocab.t2d)
    # Resuming the second run: its own checkpoint, not the head (which now differs from it).
    other = export_draft_head(read_run_head(first, 1)[0], tmp_path / "other")
    train(dataclasses.replace(cfg, init_head=str(other), total_steps=2),
          target_override=override, train_records=records)
    assert read_run_head(second)[1] == 2
    with pytest.raises(ConfigError, match="init_head='/nope' is neither"):
        train(TrainConfig(out_dir=str(tmp_path / "x"), total_steps=1, init_head="/nope",
                          **common), target_override=override, train_records=records)
    wide = export_draft_head(random_head(TINY, 200), tmp_path / "wide")  # another target's
    with pytest.raises(ConfigError, match="does not fit the target"):
        train(TrainConfig(out_dir=str(tmp_path / "y"), total_steps=1, init_head=str(wide),
                          **common), target_override=override, train_records=records)
