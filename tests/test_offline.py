"""Offline features: stored taps/hidden equal the target's forward (to the storage precision), the
TTT batch built from them equals the one online training builds, shards resume, and features
that do not fit the target fail clearly."""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from eagle3_jax.checkpoints import LoadedTarget
from eagle3_jax.data import DataError, TokenizedRecords, make_dataset
from eagle3_jax.data.__main__ import main
from eagle3_jax.data.features import FeatureShards, extract_features, make_feature_iterator
from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.params import VocabMap, init_draft_params
from eagle3_jax.draft.ttt import ttt_forward
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import init_params
from eagle3_jax.model.target import forward_stacked, packed_causal_mask
from eagle3_jax.train.inputs import (FeatureError, features_ttt_batch, labels_from_hidden,
                                     target_head_rows, target_ttt_batch)

V, D, MAX_LEN, BATCH = 96, 32, 32, 4


def tiny_target(hidden=D, tie=False, seed=0):
    cfg = TargetConfig(arch="llama", vocab_size=V, hidden_size=hidden, intermediate_size=64,
                       num_layers=7, num_heads=4, num_kv_heads=2, head_dim=8,
                       max_position_embeddings=256, tie_word_embeddings=tie)
    return LoadedTarget(cfg, init_params(cfg, jax.random.key(seed), scale=0.3), None,
                        f"tiny-random-{hidden}")


def synthetic_records(n=10, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        length = int(rng.integers(5, 45))  # some longer than MAX_LEN: truncated
        rows.append((rng.integers(0, V, length).astype(np.int32),
                     rng.random(length) < 0.7))
    return TokenizedRecords.from_arrays(rows, [f"r{i}" for i in range(n)])


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def records():
    return synthetic_records()


@pytest.fixture(scope="module")
def stored(tmp_path_factory, target, records):
    """Features of ``records`` in each storage dtype (4 records a shard: 3 shards)."""
    out = {}
    for dtype in ("float32", "bfloat16", "float16"):
        path = tmp_path_factory.mktemp(dtype)
        stats = extract_features(records, target, path, max_len=MAX_LEN, batch_size=BATCH,
                                 dtype=dtype, records_per_shard=4)
        assert (stats.shards, stats.shards_written, stats.records) == (3, 3, 10)
        out[dtype] = path
    return out


_REFERENCE = {}


def reference_features(target, tokens):
    """taps [T, 3D], hidden [T, D] of one unpadded record, float32 (cached per record)."""
    key = tokens.tobytes()
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference_features(target, tokens)
    return _REFERENCE[key]


def _reference_features(target, tokens):
    t = len(tokens)
    out = forward_stacked(target.params, target.cfg, jnp.asarray(tokens)[None],
                          jnp.arange(t, dtype=jnp.int32)[None],
                          packed_causal_mask(jnp.ones((1, t))),
                          tap_layers=target.cfg.eagle3_tap_layers, compute_logits=False)
    return np.asarray(out.taps[0]), np.asarray(out.hidden[0])


# Largest relative rounding error of each storage dtype (half an ulp: 2^-(mantissa bits + 1)).
REL_ERROR = {"float32": 1e-5, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_stored_features_equal_target_forward(stored, target, records, dtype):
    shards = FeatureShards(stored[dtype])
    assert len(shards) == len(records)
    assert shards.record_id(9) == "r9"
    for i in range(len(records)):
        got = shards[i]
        tokens = records[i]["input_ids"][:MAX_LEN]
        np.testing.assert_array_equal(got["input_ids"], tokens)
        np.testing.assert_array_equal(got["loss_mask"], records[i]["loss_mask"][:MAX_LEN])
        taps, hidden = reference_features(target, tokens)
        assert got["taps"].dtype == np.dtype(getattr(ml_dtypes, dtype, dtype))
        assert got["taps"].shape == (len(tokens), 3 * D)
        for name, want in (("taps", taps), ("hidden", hidden)):
            have = np.asarray(got[name], np.float32)
            # Relative to each value, plus float32 round-off of the (padded, batched) forward.
            tol = REL_ERROR[dtype] * np.abs(want) + 1e-5 * np.abs(want).max()
            assert np.all(np.abs(have - want) <= tol), (dtype, name, i)


def online_and_offline_batches(records, path, max_len=MAX_LEN, pack=False):
    """The same pipeline (make_dataset) over token records and over their stored features."""
    kwargs = dict(batch_size=BATCH, max_len=max_len, seed=0, shuffle=False, num_epochs=1,
                  shard_index=0, shard_count=1, pack=pack)
    online = list(make_dataset(records, **kwargs))
    offline = list(make_dataset(FeatureShards(path), **kwargs))
    assert len(online) == len(offline) and (pack or len(online) == 3)
    return online, offline


def draft_setup(target):
    draft_cfg = DraftConfig.for_target(target.cfg, draft_vocab_size=64, ttt_steps=3)
    used = np.sort(np.random.default_rng(1).choice(V, 64, replace=False))
    vocab = VocabMap.from_used_ids(used, V)
    params = init_draft_params(draft_cfg, jax.random.key(2))
    return draft_cfg, vocab, params


@pytest.mark.parametrize("pack", [False, True])
def test_features_ttt_batch_equals_online_float32(stored, target, records, pack):
    """Padded or packed, the features batch's TTT inputs are the online ones (the packed taps
    came from one-document forwards, the online ones from a packed forward: equal, as the
    attention mask keeps documents apart)."""
    draft_cfg, vocab, draft_params = draft_setup(target)
    head = target_head_rows(target.params, target.cfg)
    online_fn = jax.jit(lambda b: target_ttt_batch(target.params, target.cfg, draft_cfg, vocab, b))
    offline_fn = jax.jit(lambda b: features_ttt_batch(head, draft_cfg, vocab, b))
    loss_fn = jax.jit(lambda b: ttt_forward(draft_params, draft_cfg, target.params["embed"], b))
    online, offline = online_and_offline_batches(records, stored["float32"], pack=pack)
    for on_batch, off_batch in zip(online, offline):
        assert set(off_batch) == set(on_batch) | {"taps", "hidden"}
        assert off_batch["taps"].shape == (BATCH, MAX_LEN, 3 * D)
        assert not off_batch["hidden"][off_batch["segment_ids"] == 0].any()  # zero padding
        for k in on_batch:
            np.testing.assert_array_equal(on_batch[k], off_batch[k])
        on, off = online_fn(on_batch), offline_fn(off_batch)
        real = on_batch["segment_ids"] > 0  # padding taps differ (zeros offline) and are unused
        # Padded, the two forwards are one computation. Packed, the online forward's attention
        # sums over more (masked) keys, so float32 rounds differently: up to 1.9e-5 on taps of
        # about 1 (2026-12-07, 2-core Xeon, XLA at -O0; 1.1e-5 at its default level, where the
        # same forward at the two levels differs by up to 4e-5). A leak across documents would
        # move the taps by about their own size.
        tol = 5e-5 if pack else 1e-5
        np.testing.assert_allclose(off.taps[real], on.taps[real], rtol=tol, atol=tol)
        np.testing.assert_allclose(off.target_logp[real], on.target_logp[real], atol=1e-5)
        np.testing.assert_array_equal(off.target_in_draft[real], on.target_in_draft[real])
        loss_on, m_on = loss_fn(on)
        loss_off, m_off = loss_fn(off)
        np.testing.assert_allclose(loss_off, loss_on, rtol=1e-5)
        np.testing.assert_allclose(m_off["acc_per_step"], m_on["acc_per_step"], atol=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_features_ttt_batch_low_precision(stored, target, records, dtype):
    """From rounded features the labels are exactly the labels of the rounded hidden state."""
    draft_cfg, vocab, _ = draft_setup(target)
    head = target_head_rows(target.params, target.cfg)
    _, offline = online_and_offline_batches(records, stored[dtype])
    _, exact = online_and_offline_batches(records, stored["float32"])
    for off_batch, f32_batch in zip(offline, exact):
        off = features_ttt_batch(head, draft_cfg, vocab, off_batch)
        rounded = jnp.asarray(f32_batch["hidden"]).astype(dtype).astype(jnp.float32)
        want_logp, want_in_draft = labels_from_hidden(rounded, head, vocab)
        real = f32_batch["segment_ids"] > 0
        np.testing.assert_allclose(off.target_logp[real], want_logp[real], atol=1e-5)
        np.testing.assert_array_equal(off.target_in_draft[real], want_in_draft[real])
        assert off.taps.dtype == jnp.float32


def test_resume_by_shard(tmp_path, target, records, stored):
    out = tmp_path / "f"
    shutil.copytree(stored["bfloat16"], out)
    shutil.rmtree(out / "features-00001")
    (out / ".features-00002.tmp").mkdir()  # an interrupted write: ignored, not a shard
    with pytest.raises(DataError, match="1 of 3 shards missing"):
        FeatureShards(out)
    before = (out / "features-00000" / "taps.npy").stat().st_mtime_ns
    stats = extract_features(records, target, out, max_len=MAX_LEN, batch_size=BATCH,
                             dtype="bfloat16", records_per_shard=4)
    assert stats.shards_written == 1
    assert (out / "features-00000" / "taps.npy").stat().st_mtime_ns == before
    for name in ("taps", "hidden", "input_ids"):
        np.testing.assert_array_equal(
            np.load(out / "features-00001" / f"{name}.npy"),
            np.load(stored["bfloat16"] / "features-00001" / f"{name}.npy"))
    # Other settings (or other records, or another target) in the same folder are refused.
    with pytest.raises(DataError, match="other settings.*dtype"):
        extract_features(records, target, out, max_len=MAX_LEN, dtype="float16",
                         records_per_shard=4)
    with pytest.raises(DataError, match="other settings.*hidden_size"):
        extract_features(records, tiny_target(hidden=48), out, max_len=MAX_LEN,
                         dtype="bfloat16", records_per_shard=4)


@pytest.mark.parametrize("pack", [False, True])
def test_iterator_state_and_shuffle(stored, pack):
    kwargs = dict(batch_size=2, max_len=MAX_LEN, seed=5, shuffle=True, shard_index=0,
                  shard_count=1, pack=pack)
    it = make_feature_iterator(stored["bfloat16"], **kwargs)
    next(it), next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(3)]
    resumed = make_feature_iterator(stored["bfloat16"], **kwargs)
    resumed.set_state(json.loads(json.dumps(state)))
    for want in expected:
        got = next(resumed)
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k], np.float32),
                                          np.asarray(want[k], np.float32))
    assert expected[0]["taps"].shape == (2, MAX_LEN, 3 * D)
    assert expected[0]["hidden"].dtype == ml_dtypes.bfloat16


def test_wrong_target_and_bad_input(stored, target, records, tmp_path):
    draft_cfg, vocab, _ = draft_setup(target)
    _, offline = online_and_offline_batches(records, stored["bfloat16"])
    other = tiny_target(hidden=48)
    with pytest.raises(FeatureError, match="made with another target"):
        features_ttt_batch(target_head_rows(other.params, other.cfg),
                           DraftConfig.for_target(other.cfg, ttt_steps=3), vocab, offline[0])
    with pytest.raises(DataError, match="hidden size 32.*has 48"):
        FeatureShards(stored["bfloat16"]).check_target(48)
    FeatureShards(stored["bfloat16"]).check_target(D, target.cfg.eagle3_tap_layers)

    with pytest.raises(DataError, match="does not exist"):
        extract_features(tmp_path / "missing.npz", target, tmp_path / "o", max_len=MAX_LEN)
    with pytest.raises(DataError, match="not a features folder"):
        FeatureShards(tmp_path)
    big = TokenizedRecords.from_arrays([(np.array([1, V + 5], np.int32), np.ones(2, bool))])
    with pytest.raises(DataError, match="tokenised for another target"):
        extract_features(big, target, tmp_path / "o", max_len=MAX_LEN)
    with pytest.raises(DataError, match="feature dtype"):
        extract_features(records, target, tmp_path / "o", max_len=MAX_LEN, dtype="int8")


def test_cli_features_smollm2(smollm2_gguf_path, tmp_path, capsys):
    rng = np.random.default_rng(0)
    recs = TokenizedRecords.from_arrays(
        [(rng.integers(0, 49152, n).astype(np.int32), np.ones(n, bool)) for n in (12, 20, 3)])
    data = recs.save(tmp_path / "tokens.npz")
    out = tmp_path / "features"
    argv = ["features", "--data", str(data), "--target", str(smollm2_gguf_path), "--out",
            str(out), "--max-len", "16", "--batch-size", "2", "--records-per-shard", "2"]
    assert main(argv) == 0
    shards = FeatureShards(out)
    assert len(shards) == 3 and shards.hidden_size == 576
    assert shards.tap_layers == (2, 15, 27)
    assert shards[1]["taps"].shape == (16, 3 * 576) and shards[2]["hidden"].shape == (3, 576)
    assert "2 written now" in capsys.readouterr().out
    assert main(argv) == 0  # resumed: nothing left to do
    assert "0 written now" in capsys.readouterr().out
    assert main(["features", "--data", str(tmp_path / "nope.npz"), "--target",
                 str(smollm2_gguf_path), "--out", str(out), "--max-len", "16"]) == 2
    assert "does not exist" in capsys.readouterr().err
