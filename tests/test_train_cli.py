"""``python -m eagle3_jax.train``: a typo in the config (the target, any path) is one line and
exit status 2 before anything loads; ``--debug`` adds the traceback; errors that are not the
user's keep theirs. The path checks name the key the user typed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_jax.draft.load import VOCAB_FILE
from eagle3_jax.model.config import ConfigError
from eagle3_jax.train import loop
from eagle3_jax.train.__main__ import main
from eagle3_jax.train.config import TrainConfig, check_paths

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def inputs(tmp_path):
    """Existing stand-ins for every path key (contents are never read by the checks)."""
    (tmp_path / "tokens.npz").write_bytes(b"not an npz")
    (tmp_path / "vocab.npz").write_bytes(b"not an npz")
    (tmp_path / "feats").mkdir()
    (tmp_path / "feats" / "features.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    return tmp_path


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if the run gets as far as reading data or the target."""

    def refuse(*args, **kwargs):
        raise AssertionError("loaded data or the target before checking the config's paths")

    monkeypatch.setattr(loop, "_load_data", refuse)
    monkeypatch.setattr(loop, "load_frozen_target", refuse)


def test_typo_in_target_is_one_line_exit_2_before_anything_loads(inputs):
    # train_data exists but is not an npz: had the data loaded first, the error would be its.
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-m", "eagle3_jax.train", "target=smollm2-135n",
         f"train_data={inputs / 'tokens.npz'}", f"out_dir={inputs / 'run'}"],
        capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert "target='smollm2-135n'" in lines[0] and "set target=" in lines[0]
    assert "did you mean target=smollm2-135m" in lines[0]
    assert not (inputs / "run").exists()  # nothing was set up


def test_cli_checks_paths_before_loading(inputs, nothing_loads, capsys):
    args = ["target=smollm2-135m", f"out_dir={inputs / 'run'}"]
    assert main([*args, f"train_data={inputs / 'missing.npz'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train_data=" in err and "missing.npz" in err
    assert "Traceback" not in err
    assert main([*args, f"train_data={inputs / 'missing.npz'}", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "ConfigError" in err and "train_data=" in err


def test_errors_that_are_not_the_users_keep_their_traceback(inputs, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("an internal bug")

    monkeypatch.setattr(loop, "_setup", broken)
    with pytest.raises(ValueError, match="an internal bug"):
        main([f"train_data={inputs / 'tokens.npz'}", f"out_dir={inputs / 'run'}"])


def test_train_checks_paths_first(inputs, nothing_loads):
    cfg = TrainConfig(target="random:smollm2-135m", train_data=str(inputs / "missing.npz"),
                      out_dir=str(inputs / "run"))
    with pytest.raises(ConfigError, match="train_data="):
        loop.train(cfg)


@pytest.mark.parametrize("changes, message", [
    ({"target": "no-such-model"}, r"target='no-such-model' is neither a preset nor"),
    ({"target": "random:no-such"}, r"target='random:no-such': unknown preset"),
    ({"target": "llama-3.1-8b-instruct"}, r"target='llama-3.1-8b-instruct' is a preset "
                                           r"without weights; set target="),
    ({"train_data": None}, r"set train_data= .* or train_features="),
    ({"train_data": "missing.npz"}, r"train_data='.*missing.npz' does not exist; set train_data="),
    ({"train_data": "empty"}, r"train_data='.*empty' is a folder, not a file"),
    ({"eval_data": "missing.npz"}, r"eval_data='.*missing.npz' does not exist"),
    ({"draft_vocab": "missing.npz"}, r"draft_vocab='.*missing.npz' does not exist"),
    ({"train_features": "missing"}, r"train_features='.*missing' does not exist"),
    ({"train_features": "empty"}, r"train_features='.*empty' holds no features.json"),
    ({"train_features": "feats", "eval_features": "empty"}, r"eval_features='.*empty' holds no"),
    ({"out_dir": "tokens.npz"}, r"out_dir='.*tokens.npz' is a file; set out_dir="),
])
def test_each_path_is_checked_by_its_key(inputs, changes, message):
    paths = {k: str(inputs / v) if v is not None and k != "target" else v
             for k, v in changes.items()}
    base = {"train_data": str(inputs / "tokens.npz"), "out_dir": str(inputs / "run")}
    with pytest.raises(ConfigError, match=message):
        check_paths(TrainConfig(**{**base, **paths}))


def test_a_hub_id_target_is_checked_in_the_hub_cache(inputs, tmp_path, monkeypatch):
    """``target=org/name`` resolves through the Hugging Face cache (offline here) before
    anything loads; an id the cache does not hold is refused with the cache it read."""
    from hub_cache import add_to_hub_cache, use_hub_cache

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    add_to_hub_cache(tmp_path / "hub", "some-org/tiny", model)
    use_hub_cache(monkeypatch, tmp_path / "hub")
    base = {"train_data": str(inputs / "tokens.npz"), "out_dir": str(inputs / "run")}
    check_paths(TrainConfig(target="some-org/tiny", **base))
    with pytest.raises(ConfigError, match=r"target='some-org/gone' is no path and no preset, "
                                          r"and as a hub id: .*not in the Hugging Face cache"):
        check_paths(TrainConfig(target="some-org/gone", **base))


def test_what_a_run_does_not_read_is_not_checked(inputs):
    good = {"train_data": str(inputs / "tokens.npz"), "draft_vocab": str(inputs / "vocab.npz"),
            "out_dir": str(inputs / "run")}
    for target in ("smollm2-135m", "random:smollm2-135m", str(inputs / "empty")):
        check_paths(TrainConfig(target=target, **good))
    # Offline runs do not read train_data / eval_data.
    check_paths(TrainConfig(train_features=str(inputs / "feats"), eval_data="missing.npz",
                            **{**good, "train_data": "missing.npz"}))
    # In memory: the target and the records; a resumed run reuses its copy of the vocabulary.
    cfg = TrainConfig(target="tiny", train_data=None, draft_vocab="gone.npz",
                      out_dir=str(inputs / "run"))
    (inputs / "run").mkdir()
    (inputs / "run" / VOCAB_FILE).write_bytes(b"")
    loop.check_inputs(cfg, target_override=object(), train_records=[])
    with pytest.raises(ConfigError, match="target='tiny'"):
        loop.check_inputs(cfg, train_records=[])
