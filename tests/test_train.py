"""The training loop on a tiny random target: it learns, it resumes exactly, it keeps N
checkpoints, it writes metrics and a plot; offline training from stored float32 features gives
the online losses and resumes exactly; bad configs, features and checkpoints fail clearly."""

import dataclasses
import json
import shutil
from pathlib import Path

import grain
import jax
import numpy as np
import optax
import pytest

from eagle3_jax.checkpoints import LoadedTarget
from eagle3_jax.data import DataError, TokenizedRecords, make_train_iterator
from eagle3_jax.data.features import extract_features
from eagle3_jax.model.config import ConfigError, TargetConfig
from eagle3_jax.model.params import init_params
from eagle3_jax.train.checkpointing import TrainCheckpointError, TrainCheckpointer, abstract_state
from eagle3_jax.train.config import OptimizerConfig, TrainConfig, load_train_config
from eagle3_jax.train.loop import TargetOverride, train
from eagle3_jax.train.metrics import read_metrics
from eagle3_jax.train.step import TrainState

V = 96
STEPS = 30
REPO = Path(__file__).resolve().parents[1]


def tiny_target():
    """7 layers so the taps 2, 3, 4 are distinct. Larger embedding / head scales and damped
    residual writes make the target's next-token choice depend mostly on the current token,
    so a draft can learn it in a few dozen steps."""
    cfg = TargetConfig(arch="llama", vocab_size=V, hidden_size=32, intermediate_size=64,
                       num_layers=7, num_heads=4, num_kv_heads=2, head_dim=8,
                       max_position_embeddings=256)
    params = init_params(cfg, jax.random.key(0), scale=0.3)
    params["embed"] = params["embed"] * 3
    params["lm_head"] = params["lm_head"] * 3
    for name in ("wo", "w_down"):
        params["layers"][name] = params["layers"][name] * 0.2
    return TargetOverride(cfg, params)


def synthetic_records(n=64, seed=0):
    """Arithmetic token progressions (strides 1 and 7): predictable, varied lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(16, 40))
        start, stride = int(rng.integers(0, V)), (1, 7)[i % 2]
        out.append({"input_ids": ((start + stride * np.arange(length)) % V).astype(np.int32),
                    "loss_mask": np.arange(length) >= 4})
    return out


def run_config(out_dir, **changes):
    fields = dict(target="tiny", out_dir=str(out_dir), max_len=32, batch_size=8, grad_accum=2,
                  ttt_steps=3, draft_vocab_size=V, total_steps=STEPS, save_every=5,
                  keep_checkpoints=2, eval_every=15, eval_batches=2, log_every=1,
                  eval_fraction=0.1, progress=False,
                  optimizer=OptimizerConfig(learning_rate=2e-2, warmup_steps=2))
    fields.update(changes)
    return TrainConfig(**fields)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def records():
    return synthetic_records()


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, target, records):
    out = tmp_path_factory.mktemp("full")
    return train(run_config(out), target_override=target, train_records=records)


def test_loss_falls_and_accuracy_rises(full_run):
    losses = full_run["losses"]
    assert len(losses) == STEPS and all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:3]) - 1.0
    rows = [r for r in read_metrics(Path(full_run["out_dir"]) / "metrics.jsonl")
            if r["kind"] == "train"]
    first = np.mean([r["acc_per_step"][0] for r in rows[:3]])
    last = np.mean([r["acc_per_step"][0] for r in rows[-5:]])
    assert last > first + 0.1, (first, last)


def test_metrics_plot_and_eval(full_run):
    out = Path(full_run["out_dir"])
    rows = read_metrics(out / "metrics.jsonl")
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
    for key in ("loss", "loss_per_step", "acc_per_step", "grad_norm", "lr", "tokens_per_s"):
        assert key in train_rows[-1]
    assert len(train_rows[-1]["acc_per_step"]) == 3
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [15, 30]
    acc = evals[-1]["acc_per_step"]
    expected = 1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2]
    assert evals[-1]["accept_length"] == pytest.approx(expected)
    assert full_run["eval"]["accept_length"] == pytest.approx(expected)
    png = out / "accuracy.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_keeps_last_n_checkpoints(full_run):
    assert full_run["checkpoint_steps"] == [25, 30]
    steps = sorted(int(p.name) for p in (Path(full_run["out_dir"]) / "checkpoints").iterdir()
                   if p.name.isdigit())
    assert steps == [25, 30]


def test_kill_and_resume_gives_identical_losses(tmp_path, full_run, target, records):
    cfg = run_config(tmp_path, keep_checkpoints=5)
    first = train(cfg, max_steps=15, target_override=target, train_records=records)
    assert first["checkpoint_steps"] == [5, 10, 15]
    # Killed after step 15's metrics were logged but before its checkpoint was complete.
    shutil.rmtree(tmp_path / "checkpoints" / "15")
    resumed = train(cfg, target_override=target, train_records=records)
    assert resumed["start_step"] == 10 and resumed["end_step"] == STEPS
    np.testing.assert_array_equal(first["losses"], full_run["losses"][:15])  # bitwise
    np.testing.assert_array_equal(resumed["losses"], full_run["losses"][10:])
    # The metrics log was rewound to step 10 and continued: one record per step.
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, STEPS + 1))


# ---------------------------------------------------------------------------------------------
# Offline training from stored features.

OFFLINE_STEPS = 8


def store_features(target, records, out_dir, dtype="float32"):
    tokens = TokenizedRecords.from_arrays([(r["input_ids"], r["loss_mask"]) for r in records])
    loaded = LoadedTarget(target.cfg, target.params, None, "tiny")
    extract_features(tokens, loaded, out_dir, max_len=32, batch_size=16, dtype=dtype,
                     records_per_shard=32)
    return str(out_dir)


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory, target, records):
    """The run of ``full_run`` (same records, held-out split, seed and schedule), but from
    float32 features: stopped after OFFLINE_STEPS steps."""
    features = store_features(target, records, tmp_path_factory.mktemp("features"))
    cfg = run_config(tmp_path_factory.mktemp("offline"), train_features=features,
                     keep_checkpoints=5, save_every=4)
    return cfg, train(cfg, max_steps=OFFLINE_STEPS, target_override=target)


def test_offline_losses_equal_online(offline_run, full_run):
    _, summary = offline_run
    assert summary["end_step"] == OFFLINE_STEPS and summary["eval"] is not None
    # Same batches, same labels up to float32 round-off of the target's forward, same update.
    np.testing.assert_allclose(summary["losses"], full_run["losses"][:OFFLINE_STEPS],
                               rtol=1e-5, atol=1e-5)


def test_offline_kill_and_resume_is_exact(tmp_path, offline_run, target):
    cfg, first = offline_run
    out = tmp_path / "run"
    shutil.copytree(cfg.out_dir, out)
    shutil.rmtree(out / "checkpoints" / str(OFFLINE_STEPS))  # killed before the last save
    resumed = train(cfg.replace(out_dir=str(out)), max_steps=OFFLINE_STEPS,
                    target_override=target)
    assert resumed["start_step"] == OFFLINE_STEPS - 4
    np.testing.assert_array_equal(resumed["losses"], first["losses"][-4:])  # bitwise


def test_offline_refuses_features_of_another_target(tmp_path, target, records):
    other = tiny_target()
    cfg48 = dataclasses.replace(other.cfg, hidden_size=48)
    other = TargetOverride(cfg48, init_params(cfg48, jax.random.key(3), scale=0.3))
    features = store_features(other, records[:4], tmp_path / "features48")
    with pytest.raises(DataError, match="hidden size 48.*has 32.*another target"):
        train(run_config(tmp_path / "run", train_features=features), target_override=target)
    with pytest.raises(ConfigError, match="for online training"):
        train(run_config(tmp_path / "run", train_features=features), target_override=target,
              train_records=records)
    with pytest.raises(ConfigError, match="eval_features is set but train_features is not"):
        run_config(tmp_path / "run", eval_features=features)


# ---------------------------------------------------------------------------------------------
# Checkpoint files directly (no training).


def _toy_state(seed=0):
    params = {"w": jax.random.normal(jax.random.key(seed), (8, 4))}
    opt = optax.adam(1e-3)
    return TrainState.create(params, opt, jax.random.key(seed + 1)), opt


def _toy_iterator():
    recs = [{"input_ids": np.arange(5 + i, dtype=np.int32), "loss_mask": np.ones(5 + i, bool)}
            for i in range(10)]
    return make_train_iterator(recs, batch_size=2, max_len=8, seed=0, shard_index=0,
                               shard_count=1)


def _abstract(state):
    shardings = jax.tree.map(lambda x: x.sharding, state)
    return abstract_state(jax.eval_shape(lambda: state), shardings)


def test_checkpoint_roundtrip_and_killed_save(tmp_path, monkeypatch):
    state, _ = _toy_state()
    it = _toy_iterator()
    next(it)
    ckpt = TrainCheckpointer(tmp_path, max_to_keep=3)
    ckpt.save(1, state, it, {"note": "one"})
    expected_next = next(_restored_iter(tmp_path))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(grain.checkpoint.CheckpointHandler, "save", killed)
    newer, _ = _toy_state(seed=5)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(2, newer, it, {"note": "two"})
    monkeypatch.undo()
    assert not (tmp_path / "2").exists()  # only an orbax temporary folder, if anything

    reopened = TrainCheckpointer(tmp_path, max_to_keep=3)
    assert reopened.all_steps() == [1]
    it2 = _toy_iterator()
    restored, meta = reopened.restore(_abstract(state), it2)
    assert meta["note"] == "one" and meta["step"] == 1
    np.testing.assert_array_equal(restored.params["w"], state.params["w"])
    np.testing.assert_array_equal(jax.random.key_data(restored.rng),
                                  jax.random.key_data(state.rng))
    np.testing.assert_array_equal(next(it2)["tokens"], expected_next["tokens"])


def _restored_iter(directory):
    state, _ = _toy_state()
    it = _toy_iterator()
    TrainCheckpointer(directory).restore(_abstract(state), it)
    return it


def test_corrupt_or_missing_checkpoint_raises_clear_error(tmp_path):
    state, _ = _toy_state()
    with pytest.raises(TrainCheckpointError, match="no checkpoint in"):
        TrainCheckpointer(tmp_path / "empty").restore(_abstract(state))
    ckpt = TrainCheckpointer(tmp_path / "run", max_to_keep=3)
    ckpt.save(1, state, None, {})
    ckpt.save(2, state, None, {})
    for f in (tmp_path / "run" / "2" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(TrainCheckpointError, match=r"corrupt.*delete .*2 to resume from step 1"):
        TrainCheckpointer(tmp_path / "run").restore(_abstract(state))
    # The older step is still usable.
    restored, _ = TrainCheckpointer(tmp_path / "run").restore(_abstract(state), step=1)
    np.testing.assert_array_equal(restored.params["w"], state.params["w"])


# ---------------------------------------------------------------------------------------------
# Config.


def test_config_yaml_and_overrides(tmp_path):
    cfg = load_train_config(REPO / "configs" / "train-smollm2-135m.yaml",
                            ["total_steps=7", "optimizer.learning_rate=3e-4", "mesh.data=1",
                             "eval_data=null", "pack=false"])
    assert cfg.total_steps == 7 and cfg.optimizer.total_steps == 7
    assert cfg.optimizer.learning_rate == 3e-4 and isinstance(cfg.optimizer.learning_rate, float)
    assert cfg.mesh.data == 1 and cfg.pack is False and cfg.eval_data is None
    # to_dict -> from_dict is the identity (the checkpoint metadata relies on it).
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("overrides, message", [
    (["learning_rate=1e-4"], r"unknown key\(s\) \['learning_rate'\]"),
    (["optimizer.lr=1e-4"], r"unknown key\(s\) \['optimizer.lr'\]"),
    (["optimizer.learning_rate=-1e-4"], "learning_rate must be > 0"),
    (["batch_size=0"], "batch_size must be a positive integer"),
    (["batch_size=eight"], "batch_size must be int"),
    (["optimizer.total_steps=5"], "unknown key"),
    (["dtype=float64"], "dtype must be one of"),
    (["mesh.data=0"], "mesh"),
    (["total_steps"], "must look like key=value"),
])
def test_bad_config_is_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(REPO / "configs" / "train-smollm2-135m.yaml", overrides)


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("target: smollm2-135m\nbatch_sizes: 4\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key\(s\) \['batch_sizes'\]"):
        load_train_config(path)


def test_bfloat16_target_trains_float32_master_weights(tmp_path, records):
    """A bfloat16 target (dtype: bfloat16) keeps the draft's master weights and AdamW moments in
    float32 and computes in bfloat16: stored bfloat16 weights would drop every update below half
    an ulp (lr 1e-4 on weights of order 0.3: an ulp there is 2e-3)."""
    import orbax.checkpoint as ocp

    base = tiny_target()
    cfg16 = base.cfg.replace(dtype="bfloat16")
    target16 = TargetOverride(cfg16, jax.tree.map(lambda x: x.astype("bfloat16"), base.params))
    out = tmp_path / "bf16"
    result = train(run_config(out, dtype="bfloat16", total_steps=3, save_every=3, eval_every=3,
                              optimizer=OptimizerConfig(learning_rate=1e-4, warmup_steps=1)),
                   target_override=target16, train_records=records)
    assert np.all(np.isfinite(result["losses"]))
    meta = ocp.PyTreeCheckpointer().metadata(out / "checkpoints" / "3" / "state")
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
    dtypes = {str(leaf.dtype) for leaf in jax.tree.leaves(tree["params"])}
    assert dtypes == {"float32"}, dtypes
    moments = [leaf for leaf in jax.tree.leaves(tree["opt_state"]) if leaf.shape]
    assert moments and {str(m.dtype) for m in moments} == {"float32"}


def test_small_updates_survive_in_float32_master_weights():
    """The reason for the above: the same AdamW step (lr 1e-4) on weights of order 0.3 changes
    nearly every weight held in float32 and almost none held in bfloat16 (an ulp there is 2e-3)."""
    w = 0.3 * jax.random.normal(jax.random.key(0), (64, 64))
    grad = jax.random.normal(jax.random.key(1), (64, 64))
    optimizer = optax.adamw(1e-4)
    changed = {}
    for master in ("float32", "bfloat16"):
        params = w.astype(master)
        updates, _ = optimizer.update(grad.astype(master), optimizer.init(params), params)
        new = optax.apply_updates(params, updates)
        changed[master] = float(np.mean(np.asarray(new, np.float32)
                                        != np.asarray(params, np.float32)))
    assert changed["float32"] > 0.9 and changed["bfloat16"] < 0.2, changed
