"""Offline features: run the frozen target once over tokenised records and store what the draft
trains on, so training needs only the target's output head (and embedding), not the target.

Per record (truncated to ``max_len`` tokens) the folder holds
    input_ids [T] int32, loss_mask [T] bool,
    taps      [T, 3D]  the hidden states entering the EAGLE-3 tap layers (low, mid, high),
    hidden    [T, D]   the target's final *normed* hidden state.
Not the logits: ``[T, V]`` would be V/D times larger (85x for SmolLM2, 31x for Llama 3). The
soft labels are recomputed at train time as ``hidden @ head.T`` (``train/inputs.py``).

Precision on disk (``dtype``): ``bfloat16`` (default; 8-bit mantissa, relative error <= 2^-9,
float32's exponent range so the target's large outlier activations never overflow),
``float16`` (11-bit mantissa, <= 2^-12, overflows above 65504), or ``float32`` (what the target
computed, bit for bit; the labels then match online training to float32 round-off).

Layout (``out_dir``)::

    features.json            manifest: target, hidden size, tap layers, dtype, max_len,
                             records_per_shard, number of records, fingerprint of the records
    features-00000/          one folder per shard of ``records_per_shard`` records, holding
      input_ids.npy loss_mask.npy offsets.npy ids.npy taps.npy hidden.npy
                             flat over the shard's tokens (record j is offsets[j]:offsets[j+1]);
                             bfloat16 arrays are stored as their uint16 bits

A shard is written into a temporary folder and renamed into place, so it is either complete or
absent: an interrupted run resumes at the first missing shard. Every ``.npy`` is opened
memory-mapped, so a reader touches only the records it reads.

Reading: :class:`FeatureShards` is a random-access source of records {input_ids, loss_mask,
taps, hidden}; the training pipeline (``data/pipeline.py``, ``make_dataset``) batches it like
token records, carrying taps and hidden along (:func:`make_feature_iterator` is a shorthand).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from eagle3_jax.data.sources import DataError
from eagle3_jax.data.tokenize import TokenizedRecords

MANIFEST = "features.json"
SHARD_PATTERN = "features-{:05d}"
FORMAT_VERSION = 1
STORAGE_DTYPES = ("bfloat16", "float16", "float32")
_ARRAYS = ("input_ids", "loss_mask", "offsets", "ids", "taps", "hidden")


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _fingerprint(records: TokenizedRecords, max_len: int) -> str:
    h = hashlib.sha1()
    for a in (records.offsets, records.tokens, records.loss_mask, np.int64(max_len)):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


@dataclasses.dataclass
class FeatureStats:
    records: int = 0
    shards: int = 0
    shards_written: int = 0  # by this call (the rest were already there)
    tokens: int = 0          # tokens run through the target by this call
    bytes: int = 0           # bytes written by this call
    seconds: float = 0.0

    def summary(self) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        return (f"{self.records} records in {self.shards} shards ({self.shards_written} written "
                f"now: {self.tokens} tokens, {self.bytes / 2**20:.1f} MiB, {self.seconds:.1f} s, "
                f"{rate:.0f} tokens/s)")


@functools.lru_cache(maxsize=None)
def _target_fn():
    """The jitted ``(params, tokens, segment_ids, positions) -> (taps, hidden)`` forward."""
    import jax

    from eagle3_jax.model.target import forward, packed_causal_mask

    @functools.partial(jax.jit, static_argnames=("cfg", "tap_layers", "dtype"))
    def run(params, tokens, segment_ids, positions, *, cfg, tap_layers, dtype):
        out = forward(params, cfg, tokens, positions, packed_causal_mask(segment_ids),
                      tap_layers=tap_layers, compute_logits=False)
        return out.taps.astype(dtype), out.hidden.astype(dtype)

    return run


def _manifest(target: Any, records: TokenizedRecords, *, max_len: int, dtype: str,
              records_per_shard: int, tap_layers: Sequence[int]) -> dict:
    cfg = target.cfg
    return {
        "format": FORMAT_VERSION,
        "target": str(target.source),
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "tap_layers": [int(t) for t in tap_layers],
        "dtype": dtype,
        "max_len": max_len,
        "records_per_shard": records_per_shard,
        "num_records": len(records),
        "num_shards": -(-len(records) // records_per_shard),
        "records_fingerprint": _fingerprint(records, max_len),
    }


def _write_manifest(out_dir: Path, manifest: dict) -> None:
    path = out_dir / MANIFEST
    if path.is_file():
        old = json.loads(path.read_text())
        if old != manifest:
            diff = {k: (old.get(k), v) for k, v in manifest.items() if old.get(k) != v}
            raise DataError(f"{out_dir} holds features made with other settings (was, now): "
                            f"{diff}; use another --out or delete it")
        return
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(path)


def _save_shard(path: Path, arrays: Mapping[str, np.ndarray]) -> int:
    """Write ``arrays`` as .npy files into a temporary folder renamed to ``path``; bytes."""
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    size = 0
    for name, a in arrays.items():
        if a.dtype == _np_dtype("bfloat16"):
            a = a.view(np.uint16)  # .npy has no bfloat16: store the bits
        with open(tmp / f"{name}.npy", "wb") as f:
            np.save(f, a, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        size += a.nbytes
    os.replace(tmp, path)  # atomic: the shard is complete or absent
    return size


def extract_features(
    records: TokenizedRecords | str | Path,
    target: Any,
    out_dir: str | Path,
    *,
    max_len: int,
    batch_size: int = 8,
    dtype: str = "bfloat16",
    records_per_shard: int = 256,
    tap_layers: Sequence[int] | None = None,
    progress: bool = False,
) -> FeatureStats:
    """Run ``target`` over ``records`` and store taps and hidden states (module doc).

    Args:
      records: TokenizedRecords, or a path to their ``.npz`` / ``.jsonl``.
      target: a LoadedTarget (cfg, params, source), or a preset name / path to load.
      max_len: records are truncated to this many tokens.
      batch_size: records per target forward; each batch is padded to a power-of-two length.
      dtype: storage dtype, one of bfloat16, float16, float32.
      records_per_shard: records per shard folder (the unit of resumption).
      tap_layers: target layers to tap; default the EAGLE-3 choice ``2, L//2, L-3``.
    Raises:
      DataError: bad arguments, token ids outside the target's vocabulary, or an ``out_dir``
        holding features made with other settings.
    """
    import jax
    import jax.numpy as jnp

    from eagle3_jax.decoding.batching import bucket

    if dtype not in STORAGE_DTYPES:
        raise DataError(f"feature dtype must be one of {', '.join(STORAGE_DTYPES)}, got {dtype!r}")
    if max_len < 1 or batch_size < 1 or records_per_shard < 1:
        raise DataError(f"max_len ({max_len}), batch_size ({batch_size}) and records_per_shard "
                        f"({records_per_shard}) must be positive")
    if not isinstance(records, TokenizedRecords):
        records = TokenizedRecords.load(records)
    if len(records) == 0:
        raise DataError("no records to extract features from")
    if isinstance(target, (str, Path)):
        from eagle3_jax.data.regenerate import load_target_or_error

        target = load_target_or_error(target)
    cfg = target.cfg
    if max_len > cfg.max_position_embeddings:
        raise DataError(f"max_len {max_len} exceeds the target's context of "
                        f"{cfg.max_position_embeddings} tokens")
    if records.tokens.size and int(records.tokens.max()) >= cfg.vocab_size:
        raise DataError(f"the records hold token id {int(records.tokens.max())}, outside the "
                        f"target's vocabulary of {cfg.vocab_size}: they were tokenised for "
                        "another target")
    tap_layers = tuple(int(t) for t in (tap_layers or cfg.eagle3_tap_layers))
    if any(not 0 <= t < cfg.num_layers for t in tap_layers):
        raise DataError(f"tap layers {tap_layers} must be in [0, {cfg.num_layers})")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = _manifest(target, records, max_len=max_len, dtype=dtype,
                         records_per_shard=records_per_shard, tap_layers=tap_layers)
    _write_manifest(out_dir, manifest)
    num_shards = manifest["num_shards"]
    stats = FeatureStats(records=len(records), shards=num_shards)
    todo = [s for s in range(num_shards) if not (out_dir / SHARD_PATTERN.format(s)).is_dir()]
    from eagle3_jax.model.params import to_serving

    run = _target_fn()
    params = to_serving(target.params, cfg)  # features run in the serving layout (forward)
    store = jnp.dtype(dtype)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=num_shards, initial=num_shards - len(todo), desc="features",
                   unit=" shard", dynamic_ncols=True)
    start = time.perf_counter()
    try:
        for s in todo:
            lo, hi = s * records_per_shard, min((s + 1) * records_per_shard, len(records))
            rows = [records[i] for i in range(lo, hi)]
            rows = [(np.asarray(r["input_ids"], np.int32)[:max_len],
                     np.asarray(r["loss_mask"], bool)[:max_len]) for r in rows]
            taps_out, hidden_out = [], []
            for b in range(0, len(rows), batch_size):
                chunk = rows[b:b + batch_size]
                width = bucket(max(len(t) for t, _ in chunk), 16, max_len)
                tokens = np.zeros((batch_size, width), np.int32)
                segments = np.zeros((batch_size, width), np.int32)
                positions = np.zeros((batch_size, width), np.int32)
                for i, (t, _) in enumerate(chunk):
                    tokens[i, :len(t)] = t
                    segments[i, :len(t)] = 1
                    positions[i, :len(t)] = np.arange(len(t))
                taps, hidden = jax.device_get(run(params, tokens, segments, positions,
                                                  cfg=cfg, tap_layers=tap_layers, dtype=store))
                for i, (t, _) in enumerate(chunk):
                    taps_out.append(taps[i, :len(t)])
                    hidden_out.append(hidden[i, :len(t)])
                stats.tokens += sum(len(t) for t, _ in chunk)
            lengths = np.array([len(t) for t, _ in rows], np.int64)
            empty = lambda width: np.zeros((0, width), _np_dtype(dtype))
            arrays = {
                "input_ids": np.concatenate([t for t, _ in rows]).astype(np.int32),
                "loss_mask": np.concatenate([m for _, m in rows]).astype(bool),
                "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                "ids": np.asarray(records.ids[lo:hi]).astype(str),
                "taps": np.concatenate(taps_out) if taps_out else empty(3 * cfg.hidden_size),
                "hidden": np.concatenate(hidden_out) if hidden_out else empty(cfg.hidden_size),
            }
            stats.bytes += _save_shard(out_dir / SHARD_PATTERN.format(s), arrays)
            stats.shards_written += 1
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        stats.seconds = time.perf_counter() - start
    return stats


# -- reading ------------------------------------------------------------------------------------

class FeatureShards:
    """A features folder as a grain random-access source.

    ``shards[i] -> {input_ids [T] int32, loss_mask [T] bool, taps [T, 3D], hidden [T, D]}``
    (taps/hidden in the stored dtype, read through memory maps). Pickles as just its path, so
    grain worker processes reopen the files themselves.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            raise DataError(f"{self.path} is not a features folder (no {MANIFEST}; run "
                            "`python -m eagle3_jax.data features` first)")
        try:
            self.manifest = json.loads(manifest.read_text())
            self.num_records = int(self.manifest["num_records"])
            self.records_per_shard = int(self.manifest["records_per_shard"])
            self.hidden_size = int(self.manifest["hidden_size"])
            self.tap_layers = tuple(int(t) for t in self.manifest["tap_layers"])
            self.dtype = _np_dtype(self.manifest["dtype"])
            num_shards = int(self.manifest["num_shards"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DataError(f"{manifest}: malformed features manifest ({e})") from None
        missing = [s for s in range(num_shards)
                   if not (self.path / SHARD_PATTERN.format(s)).is_dir()]
        if missing:
            raise DataError(f"{self.path}: {len(missing)} of {num_shards} shards missing "
                            f"(first: {SHARD_PATTERN.format(missing[0])}); run the features "
                            "command again to finish them")
        self._open: dict[int, dict[str, np.ndarray]] = {}

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])

    def __len__(self) -> int:
        return self.num_records

    def _shard(self, s: int) -> dict[str, np.ndarray]:
        if s not in self._open:
            folder = self.path / SHARD_PATTERN.format(s)
            arrays = {}
            for name in _ARRAYS:
                a = np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False)
                if name in ("taps", "hidden") and a.dtype == np.uint16:
                    a = a.view(self.dtype)
                arrays[name] = a
            self._open[s] = arrays
        return self._open[s]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        i = int(i)
        if not -self.num_records <= i < self.num_records:
            raise IndexError(f"record {i} out of range ({self.num_records} records)")
        i %= self.num_records
        shard = self._shard(i // self.records_per_shard)
        j = i % self.records_per_shard
        a, b = shard["offsets"][j], shard["offsets"][j + 1]
        return {name: shard[name][a:b] for name in ("input_ids", "loss_mask", "taps", "hidden")}

    def record_id(self, i: int) -> str:
        shard = self._shard(i // self.records_per_shard)
        return str(shard["ids"][i % self.records_per_shard])

    def check_target(self, hidden_size: int, tap_layers: Sequence[int] | None = None,
                     vocab_size: int | None = None) -> None:
        """Raise DataError unless these features fit a target of ``hidden_size`` (and a draft
        tapping ``tap_layers``, and a vocabulary of ``vocab_size``)."""
        if hidden_size != self.hidden_size:
            raise DataError(f"features in {self.path} have hidden size {self.hidden_size} (target "
                            f"{self.manifest.get('target')}), but this target/draft has "
                            f"{hidden_size}: they were made with another target")
        if tap_layers is not None and tuple(tap_layers) != self.tap_layers:
            raise DataError(f"features in {self.path} tap layers {self.tap_layers}, but the "
                            f"draft taps {tuple(tap_layers)}")
        stored_vocab = self.manifest.get("vocab_size")
        if vocab_size is not None and stored_vocab is not None and stored_vocab != vocab_size:
            raise DataError(f"features in {self.path} were made with a vocabulary of "
                            f"{stored_vocab} (target {self.manifest.get('target')}), but this "
                            f"target has {vocab_size}: they were made with another target")


def make_feature_iterator(features: FeatureShards | str | Path, **kwargs: Any):
    """Batches of stored features: :func:`eagle3_jax.data.make_train_iterator` over
    ``FeatureShards(features)`` (same arguments: global batches with this host's rows, padding
    or packing, checkpointable state). Each batch adds taps [B, T, 3D] and hidden [B, T, D] in
    the stored dtype (zeros on padding) to tokens, loss_mask, segment_ids, positions [B, T]."""
    from eagle3_jax.data.pipeline import make_train_iterator

    source = features if isinstance(features, FeatureShards) else FeatureShards(features)
    return make_train_iterator(source, **kwargs)
