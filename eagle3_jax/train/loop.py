"""The draft-head training loop: ``train(cfg)`` from config to checkpoints, metrics and a plot.

    mesh <- cfg.mesh
    data <- cfg.train_data / eval_data records  |  cfg.train_features / eval_features (offline)
    frozen target (sharded by cfg.target_sharding rules) <- cfg.target | target_override
    draft vocabulary <- out_dir/draft_vocab.npz (resume) | cfg.draft_vocab | identity | built
    TrainState <- latest checkpoint (with the data iterator position) | fresh, created sharded
    repeat: host batch [A*B_local, T, ...] -> [A, B, T, ...] global array -> jitted train_step
            log every log_every, evaluate every eval_every, checkpoint every save_every

``train`` reads as that outline: ``check_inputs`` checks that every path the config names exists
(a typo fails in milliseconds, not after the data has loaded), ``_setup`` builds a
:class:`TrainSetup` (the lines above the loop) and the starting state, ``_run_steps`` is the
loop, ``evaluate`` the held-out pass.

Two modes, one step function (``train/step.py``), one data pipeline (``data/pipeline.py``):

    online   the frozen target's full params run inside every step (TargetInputs);
    offline  cfg.train_features is a folder from ``python -m eagle3_jax.data features``: the
             batches carry the stored taps [T, 3D] and hidden states [T, D], and of the target
             only {"embed", "head_rows"} is kept (offline_frozen; the rest is dropped so its
             memory is freed). The features must fit the target (FeatureShards.check_target),
             and the draft vocabulary is built from their input_ids / loss_mask when no file
             is given. A run is, e.g.::

                 python -m eagle3_jax.data features --data tokens.npz --target T --out feats \
                     --max-len 512 --dtype float32
                 python -m eagle3_jax.train --config C.yaml train_features=feats

Resuming restores params, optimiser state, step, RNG and the grain iterator, so a killed run
continues with exactly the losses an uninterrupted run would have had (in either mode).

Run folder (``cfg.out_dir``)::

    checkpoints/<step>/   orbax steps (eagle3_jax.train.checkpointing)
    draft_vocab.npz       d2t / t2d (absent for an identity vocabulary)
    train_config.yaml     the resolved config of the latest start
    metrics.jsonl         eagle3_jax.train.metrics
    accuracy.png          per-step accuracy over training
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from eagle3_jax.decoding.acceptance import chain_accept_length
from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.load import CHECKPOINT_DIR, METRICS_FILE, VOCAB_FILE
from eagle3_jax.draft.params import VocabMap, draft_param_specs, init_draft_params
from eagle3_jax.draft.ttt import STEP_WEIGHT_DECAY
from eagle3_jax.model.config import ConfigError, TargetConfig
from eagle3_jax.model.params import Params, init_params, param_specs
from eagle3_jax.sharding import make_mesh, param_shardings
from eagle3_jax.sharding.activations import BATCH_AXES
from eagle3_jax.train.checkpointing import TrainCheckpointError, TrainCheckpointer, abstract_state
from eagle3_jax.train.config import TrainConfig, check_paths
from eagle3_jax.train.inputs import FeatureInputs, TargetInputs, offline_frozen
from eagle3_jax.train.metrics import MetricsWriter, plot_accuracy, read_metrics
from eagle3_jax.train.step import TrainState, eval_step, train_step

# The draft's master weights and optimiser moments, whatever the target's dtype: in bfloat16 an
# AdamW update below half an ulp of the weight (lr 1e-4 on weights of order 1) rounds to nothing.
MASTER_DTYPE = "float32"

log = logging.getLogger(__name__)

PLOT_FILE = "accuracy.png"


@dataclasses.dataclass(frozen=True)
class TargetOverride:
    """An in-memory target (tests, notebooks): config and params (host or device arrays)."""

    cfg: TargetConfig
    params: Params
    tokenizer: Any = None


# ---------------------------------------------------------------------------------------------
# Set-up pieces.


def load_frozen_target(cfg: TrainConfig, mesh: Mesh,
                       override: TargetOverride | None = None) -> tuple[TargetConfig, Params, str]:
    """(target config, params sharded on ``mesh``, description) for the run."""
    mode = cfg.target_sharding
    if override is not None:
        tcfg = override.cfg
        shardings = param_shardings(param_specs(tcfg), mesh, mode)
        # Every process holds the same host copy and places only its own shards (multi-host).
        host = jax.tree.map(np.asarray, override.params)
        params = jax.tree.map(
            lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]),
            host, shardings)
        return tcfg, params, "in-memory override"
    if cfg.target.startswith("random:"):
        from eagle3_jax.presets import load_preset

        tcfg = load_preset(cfg.target[len("random:"):]).target.replace(dtype=cfg.dtype)
        shardings = param_shardings(param_specs(tcfg), mesh, mode)
        init = jax.jit(init_params, static_argnums=0, out_shardings=shardings)
        return tcfg, init(tcfg, jax.random.key(cfg.seed + 1)), cfg.target
    from eagle3_jax.checkpoints import load_target

    # Training runs the target stacked (forward_stacked), whichever sharding rules place it.
    loaded = load_target(cfg.target, mesh=mesh, mode=mode, dtype=cfg.dtype, layout="stacked")
    return loaded.cfg, loaded.params, loaded.source


def _load_records(records: Any, path: str | None):
    """In-memory records as given, else the tokenised file at ``path`` (None when unset)."""
    if records is not None:
        return records
    if path is None:
        return None
    from eagle3_jax.data import TokenizedRecords

    return TokenizedRecords.load(path)


def _load_features(cfg: TrainConfig) -> tuple[Any, Any]:
    """(train, eval or None) FeatureShards of an offline run."""
    from eagle3_jax.data.features import FeatureShards

    train_src = FeatureShards(cfg.train_features)
    eval_src = FeatureShards(cfg.eval_features) if cfg.eval_features is not None else None
    for src in (train_src, eval_src):
        if src is not None and cfg.max_len > int(src.manifest.get("max_len", cfg.max_len)):
            log.warning("features in %s were cut at %s tokens, shorter than max_len %d",
                        src.path, src.manifest.get("max_len"), cfg.max_len)
    return train_src, eval_src


def check_features(sources: Sequence[Any], tcfg: TargetConfig,
                   tap_layers: Sequence[int]) -> None:
    """Raise DataError unless every FeatureShards in ``sources`` was made by this target with
    these tap layers (hidden size, taps, vocabulary)."""
    for src in sources:
        if src is not None:
            src.check_target(tcfg.hidden_size, tap_layers, tcfg.vocab_size)


class _Slice:
    """records[start:stop] as a random-access source (no copy)."""

    def __init__(self, records, start: int, stop: int):
        self.records, self.start, self.stop = records, start, stop

    def __len__(self):
        return self.stop - self.start

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.records[self.start + i]


def split_records(cfg: TrainConfig, train_records, eval_records):
    """(train, eval) sources; with no eval set, the last eval_fraction of train is held out.
    Works on any random-access source: token records or FeatureShards."""
    if train_records is None:
        raise ConfigError("train config: train_data is not set (a tokenised .npz/.jsonl from "
                          "`python -m eagle3_jax.data prepare`), nor train_features (a folder "
                          "from `python -m eagle3_jax.data features`)")
    if eval_records is not None or cfg.eval_fraction == 0 or cfg.eval_batches == 0:
        return train_records, eval_records
    n = len(train_records)
    held = max(1, int(round(n * cfg.eval_fraction)))
    if held >= n:
        return train_records, None
    return _Slice(train_records, 0, n - held), _Slice(train_records, n - held, n)


def resolve_vocab(cfg: TrainConfig, tcfg: TargetConfig, out_dir: Path, train_records,
                  init_vocab: VocabMap | None = None) -> VocabMap:
    """The run's draft vocabulary; written to ``out_dir/draft_vocab.npz`` so resume reuses it.

    ``train_records``: any random-access source of {input_ids, loss_mask} (token records or
    FeatureShards), read only when the vocabulary is built here. ``init_vocab``: the vocabulary
    of the head a new run starts from (``init_head``), which it must keep."""
    from eagle3_jax.data import build_draft_vocab, load_vocab_map, save_vocab

    saved = out_dir / VOCAB_FILE
    if saved.is_file():
        vocab = load_vocab_map(saved)
    elif init_vocab is not None:
        if cfg.draft_vocab is not None and not np.array_equal(
                np.asarray(load_vocab_map(cfg.draft_vocab).t2d), np.asarray(init_vocab.t2d)):
            raise ConfigError(f"train config: init_head={cfg.init_head!r} has its own draft "
                              f"vocabulary, not the one in draft_vocab={cfg.draft_vocab!r}; "
                              "set draft_vocab=null to keep the head's")
        vocab = init_vocab
    elif cfg.draft_vocab is not None:
        vocab = load_vocab_map(cfg.draft_vocab)
    elif cfg.draft_vocab_size >= tcfg.vocab_size:
        return VocabMap.identity(tcfg.vocab_size)
    else:
        used, counts = build_draft_vocab((train_records[i] for i in range(len(train_records))),
                                         tcfg.vocab_size, cfg.draft_vocab_size)
        save_vocab(saved, used, tcfg.vocab_size, counts)
        return VocabMap.from_used_ids(used, tcfg.vocab_size)
    if vocab.t2d.shape[0] != tcfg.vocab_size:
        raise ConfigError(f"draft vocabulary {cfg.draft_vocab or saved} covers a vocabulary of "
                          f"{vocab.t2d.shape[0]}, the target has {tcfg.vocab_size}")
    if not saved.is_file():
        used = np.asarray(vocab.draft_to_target)
        save_vocab(saved, used, tcfg.vocab_size)
    return vocab


def state_shardings(state_shapes: TrainState, param_sh: Params, mesh: Mesh) -> TrainState:
    """Shardings for a whole TrainState: optimiser leaves that mirror a parameter (Adam's mu,
    nu) take its sharding, matched by the trailing dict key and shape; the rest replicate."""
    replicated = NamedSharding(mesh, P())
    shapes = {name: x.shape for name, x in state_shapes.params.items()}

    def pick(path, leaf):
        last = path[-1] if path else None
        name = getattr(last, "key", None)
        if name in param_sh and tuple(leaf.shape) == tuple(shapes[name]):
            return param_sh[name]
        return replicated

    opt_sh = jax.tree_util.tree_map_with_path(pick, state_shapes.opt_state)
    return TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated)


def _create_state(draft_cfg: DraftConfig, optimizer: optax.GradientTransformation,
                  key: jax.Array) -> TrainState:
    init_key, state_key = jax.random.split(key)
    return TrainState.create(init_draft_params(draft_cfg, init_key), optimizer, state_key)


def abstract_train_state(draft_cfg: DraftConfig, optimizer: optax.GradientTransformation,
                         mesh: Mesh) -> tuple[TrainState, TrainState]:
    """(state shapes, state shardings) without allocating anything."""
    shapes = jax.eval_shape(functools.partial(_create_state, draft_cfg, optimizer),
                            jax.random.key(0))
    param_sh = param_shardings(draft_param_specs(draft_cfg), mesh, "training")
    return shapes, state_shardings(shapes, param_sh, mesh)


def _global_batch(host: dict[str, np.ndarray], sharding: NamedSharding, lead: tuple[int, ...],
                  global_rows: int) -> dict[str, jax.Array]:
    """Host rows [lead... x B_local, T, ...] -> global arrays [lead..., B, T, ...] sharded on
    the B axis (token arrays [.., T] and per-token features [.., T, D] alike; the trailing axes
    replicate). Dtypes are the pipeline's: int32 / bool tokens, features as stored."""
    out = {}
    for name, value in host.items():
        value = np.asarray(value)
        local = value.reshape(*lead, -1, *value.shape[1:])
        shape = (*lead, global_rows, *value.shape[1:])
        out[name] = jax.make_array_from_process_local_data(sharding, local, shape)
    return out


def _run_metadata(cfg: TrainConfig, tcfg: TargetConfig, draft_cfg: DraftConfig,
                  source: str, identity_vocab: bool) -> dict[str, Any]:
    return {"train_config": cfg.to_dict(), "draft_config": draft_cfg.to_dict(),
            "target_config": tcfg.to_dict(), "target_source": source,
            "mode": "offline" if cfg.train_features is not None else "online",
            "draft_vocab_file": None if identity_vocab else VOCAB_FILE}


# ---------------------------------------------------------------------------------------------
# Set-up: everything the step loop reads, built once.


def check_inputs(cfg: TrainConfig, *, target_override: TargetOverride | None = None,
                 train_records: Sequence | None = None,
                 eval_records: Sequence | None = None) -> None:
    """ConfigError naming the config key unless every path this run will read exists
    (:func:`~eagle3_jax.train.config.check_paths`). Touches no device and takes milliseconds,
    so a typo fails before the data, the target or a multi-host start-up. Arguments as
    :func:`train`'s: what is given in memory is not read from a path."""
    skip = set()
    if target_override is not None:
        skip.add("target")
    if train_records is not None:
        skip.add("train_data")
    if eval_records is not None:
        skip.add("eval_data")
    if (Path(cfg.out_dir) / VOCAB_FILE).is_file():
        skip.add("draft_vocab")  # a resumed run reuses its own copy (resolve_vocab)
    check_paths(cfg, skip=skip)


@dataclasses.dataclass(frozen=True)
class TrainSetup:
    """A run ready to step: built by :func:`_setup`, read by :func:`evaluate` and the loop.

    The TrainState is not held here: it is donated to every step, so it travels beside.
    """

    cfg: TrainConfig
    out_dir: Path
    draft_cfg: DraftConfig
    frozen: Params  # frozen target arrays on the mesh, as make_inputs reads them (inputs.py)
    vocab: VocabMap  # the draft vocabulary, replicated
    eval_records: Any | None  # held-out source, or None
    data_iter: Any  # the grain training iterator, at its restored position on resume
    ckpt: TrainCheckpointer
    metadata: dict[str, Any]  # saved with every checkpoint (_run_metadata)
    resumed: bool
    # (state, frozen, vocab, batch [A, B, T, ...]) -> (state, metrics); donates the state.
    step_fn: Callable
    # (params, frozen, vocab, batch [B, T, ...]) -> metrics.
    eval_fn: Callable
    batch_sh: NamedSharding  # [A, B, T(, D)]: B over the batch axes
    eval_batch_sh: NamedSharding  # [B, T(, D)]


def _make_run_mesh(cfg: TrainConfig) -> Mesh:
    mesh = make_mesh(cfg.mesh)
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.batch_size % batch_shards or cfg.batch_size % jax.process_count():
        raise ConfigError(f"train config: batch_size {cfg.batch_size} must be a multiple of the "
                          f"data x fsdp mesh size {batch_shards} and of the process count "
                          f"{jax.process_count()}")
    return mesh


def _load_data(cfg: TrainConfig, train_records, eval_records):
    """(train source, eval source or None, the offline FeatureShards or None): token records
    (in memory or cfg.train_data / eval_data) or, offline, cfg.train_features / eval_features."""
    features = None
    if cfg.train_features is not None:
        if train_records is not None or eval_records is not None:
            raise ConfigError("train_records / eval_records are for online training; an "
                              "offline run reads cfg.train_features / eval_features")
        if cfg.train_data is not None or cfg.eval_data is not None:
            log.info("offline training from %s: train_data / eval_data are not read",
                     cfg.train_features)
        features = _load_features(cfg)
        train_records, eval_records = features
    else:
        train_records = _load_records(train_records, cfg.train_data)
        eval_records = _load_records(eval_records, cfg.eval_data)
    train_records, eval_records = split_records(cfg, train_records, eval_records)
    return train_records, eval_records, features


def _init_head(cfg: TrainConfig, tcfg: TargetConfig, ckpt: TrainCheckpointer):
    """The head a new run starts from (``cfg.init_head``), or None (none named, or resuming)."""
    if cfg.init_head is None or ckpt.latest_step() is not None:
        return None
    from eagle3_jax.draft.load import load_head
    from eagle3_jax.train.config import init_head_path

    head = load_head(init_head_path(cfg.init_head), tcfg).head
    log.info("new run: starting from the head %s", cfg.init_head)
    return head


def _restore_or_create(cfg: TrainConfig, ckpt: TrainCheckpointer, draft_cfg: DraftConfig,
                       optimizer: optax.GradientTransformation, shapes: TrainState,
                       state_sh: TrainState, data_iter, init=None) -> tuple[TrainState, bool]:
    """(the latest checkpoint's state, restoring ``data_iter`` in place | a fresh state created
    sharded, from the ``init`` head's weights if given, resumed?)."""
    resume_step = ckpt.latest_step()
    if resume_step is None and init is not None:
        same = dataclasses.replace(init.cfg, ttt_steps=draft_cfg.ttt_steps, dtype=draft_cfg.dtype)
        if same != draft_cfg:
            raise ConfigError(f"train config: init_head={cfg.init_head!r} has the architecture "
                              f"{init.cfg.to_dict()}, this run builds {draft_cfg.to_dict()}")
        params = jax.tree.map(lambda x: x.astype(MASTER_DTYPE), init.params)
        create = jax.jit(lambda key, p: TrainState.create(p, optimizer, key),
                         out_shardings=state_sh)
        return create(jax.random.key(cfg.seed), params), False
    if resume_step is None:
        create = jax.jit(functools.partial(_create_state, draft_cfg, optimizer),
                         out_shardings=state_sh)
        return create(jax.random.key(cfg.seed)), False
    saved = ckpt.read_metadata(resume_step)
    try:
        saved_cfg = DraftConfig.from_dict(saved.get("draft_config") or {})
    except (ConfigError, TypeError) as e:
        raise TrainCheckpointError(f"{ckpt.directory}/{resume_step}: unreadable draft config "
                                   f"({e}); use a new out_dir") from None
    if saved_cfg != draft_cfg:
        raise TrainCheckpointError(
            f"{ckpt.directory} holds a head with config {saved.get('draft_config')}, but this "
            f"run builds {draft_cfg.to_dict()}; use a new out_dir or the original config")
    state, _ = ckpt.restore(abstract_state(shapes, state_sh), data_iter, resume_step)
    log.info("resumed from %s at step %d", ckpt.directory, resume_step)
    return state, True


def _on_mesh(mesh: Mesh, step: Callable) -> Callable:
    """``step`` called (so traced) under ``jax.set_mesh(mesh)``: inside it the activations keep
    the batch split over the mesh (``eagle3_jax.sharding.activations``)."""
    @functools.wraps(step)
    def call(*args):
        with jax.set_mesh(mesh):
            return step(*args)
    return call


def _setup(cfg: TrainConfig, target_override: TargetOverride | None = None,
          train_records: Sequence | None = None,
          eval_records: Sequence | None = None) -> tuple[TrainSetup, TrainState]:
    """Mesh, data, frozen target, vocabulary, state (restored or fresh) and the jitted steps.

    Data is read before the target, so a bad data file fails before minutes of weight loading.
    Returns (the run, its starting TrainState). Arguments as :func:`train`'s.
    """
    from eagle3_jax.data import make_train_iterator

    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mesh = _make_run_mesh(cfg)
    train_records, eval_records, features = _load_data(cfg, train_records, eval_records)
    tcfg, target_params, source = load_frozen_target(cfg, mesh, target_override)
    if features is not None:
        # DraftConfig.for_target taps the target's eagle3_tap_layers (asserted below); checked
        # before the vocabulary is counted from the features.
        check_features(features, tcfg, tcfg.eagle3_tap_layers)
    ckpt = TrainCheckpointer(out_dir / CHECKPOINT_DIR, max_to_keep=cfg.keep_checkpoints)
    init = _init_head(cfg, tcfg, ckpt)
    vocab = resolve_vocab(cfg, tcfg, out_dir, train_records,
                          init.vocab if init is not None else None)
    draft_cfg = DraftConfig.for_target(tcfg, draft_vocab_size=int(vocab.d2t.shape[0]),
                                       ttt_steps=cfg.ttt_steps, dtype=MASTER_DTYPE,
                                       fc_norm=cfg.fc_norm, norm_output=cfg.norm_output)
    if features is not None:
        assert draft_cfg.tap_layers == tuple(tcfg.eagle3_tap_layers)
        # Only the embedding table and output head; dropping the rest frees the target.
        frozen = offline_frozen(target_params, tcfg)
        make_inputs = FeatureInputs(draft_cfg)
    else:
        frozen = target_params
        make_inputs = TargetInputs(tcfg, draft_cfg)
    del target_params
    optimizer = cfg.optimizer.build()
    metadata = _run_metadata(cfg, tcfg, draft_cfg, source,
                             draft_cfg.draft_vocab_size == tcfg.vocab_size)

    replicated = NamedSharding(mesh, P())
    vocab = jax.device_put(vocab, replicated)
    shapes, state_sh = abstract_train_state(draft_cfg, optimizer, mesh)
    frozen_sh = jax.tree.map(lambda x: x.sharding, frozen)
    # Every batch array on its batch axis: tokens [A, B, T] and taps / hidden [A, B, T, D].
    batch_sh = NamedSharding(mesh, P(None, BATCH_AXES, None))
    eval_batch_sh = NamedSharding(mesh, P(BATCH_AXES, None))  # [B, T(, D)]

    data_iter = make_train_iterator(
        train_records, batch_size=cfg.batch_size * cfg.grad_accum, max_len=cfg.max_len,
        seed=cfg.seed, shuffle=cfg.shuffle, pack=cfg.pack,
        shard_index=jax.process_index(), shard_count=jax.process_count())
    state, resumed = _restore_or_create(cfg, ckpt, draft_cfg, optimizer, shapes, state_sh,
                                        data_iter, init)
    (out_dir / "train_config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    step_fn = _on_mesh(mesh, jax.jit(
        functools.partial(train_step, make_inputs=make_inputs, draft_cfg=draft_cfg,
                          optimizer=optimizer, compute_dtype=cfg.draft_compute_dtype,
                          loss_mask=cfg.loss_mask, objective=cfg.objective),
        in_shardings=(state_sh, frozen_sh, replicated, batch_sh),
        out_shardings=(state_sh, replicated), donate_argnums=(0,)))
    eval_fn = _on_mesh(mesh, jax.jit(
        functools.partial(eval_step, make_inputs=make_inputs, draft_cfg=draft_cfg,
                          compute_dtype=cfg.draft_compute_dtype, loss_mask=cfg.loss_mask,
                          objective=cfg.objective),
        in_shardings=(state_sh.params, frozen_sh, replicated, eval_batch_sh),
        out_shardings=replicated))
    run = TrainSetup(cfg=cfg, out_dir=out_dir, draft_cfg=draft_cfg, frozen=frozen, vocab=vocab,
                     eval_records=eval_records, data_iter=data_iter, ckpt=ckpt,
                     metadata=metadata, resumed=resumed, step_fn=step_fn, eval_fn=eval_fn,
                     batch_sh=batch_sh, eval_batch_sh=eval_batch_sh)
    return run, state


# ---------------------------------------------------------------------------------------------
# Evaluation.


def evaluate(run: TrainSetup, params: Params) -> dict[str, Any] | None:
    """Held-out metrics of ``params`` over the first ``cfg.eval_batches`` batches of the eval
    source (unshuffled, one epoch); None when there is no eval set.

    Per-step loss, accuracy and top-r hit rates (``hits_per_step`` [K][R]: the target's token
    among the draft's r best, r = 1..R, at TTT step = tree depth k) are weighted by the scored
    tokens of each batch; ``loss`` is the TTT loss (sum over steps of 0.8**i * loss_i) and
    ``accept_length`` the chain's simulated tokens per round.
    """
    from eagle3_jax.data import make_train_iterator

    cfg = run.cfg
    if run.eval_records is None or cfg.eval_batches == 0:
        return None
    it = make_train_iterator(run.eval_records, batch_size=cfg.batch_size, max_len=cfg.max_len,
                             seed=cfg.seed, shuffle=False, pack=cfg.pack, num_epochs=1,
                             shard_index=jax.process_index(), shard_count=jax.process_count())
    sums = None
    for _, host in zip(range(cfg.eval_batches), it):
        batch = _global_batch(host, run.eval_batch_sh, (), cfg.batch_size)
        m = jax.device_get(run.eval_fn(params, run.frozen, run.vocab, batch))
        w = m["weight_per_step"]
        part = {"loss": m["loss_per_step"] * w, "acc": m["acc_per_step"] * w, "w": w,
                "hits": m["hits_per_step"] * w[:, None]}
        sums = part if sums is None else {k: sums[k] + part[k] for k in sums}
    if sums is None:
        return None
    w = np.maximum(sums["w"], 1.0)
    acc = sums["acc"] / w
    loss_per_step = sums["loss"] / w
    decay = STEP_WEIGHT_DECAY ** np.arange(len(w))
    return {"loss": float(np.sum(decay * loss_per_step)),
            "loss_per_step": loss_per_step.tolist(), "acc_per_step": acc.tolist(),
            "hits_per_step": (sums["hits"] / w[:, None]).tolist(),
            "scored_per_step": sums["w"].tolist(),
            "accept_length": chain_accept_length(acc)}


# ---------------------------------------------------------------------------------------------
# The loop.


def _train_row(m: dict[str, Any], done: int, lr: float, tokens_per_s: float) -> dict[str, Any]:
    """The metrics.jsonl row of a logged step (``m``: the step's metrics, on the host)."""
    row = {"kind": "train", "step": done, "loss": float(m["loss"]),
           "loss_per_step": m["loss_per_step"].tolist(),
           "acc_per_step": m["acc_per_step"].tolist(),
           "grad_norm": float(m["grad_norm"]), "lr": lr, "tokens_per_s": tokens_per_s}
    if not math.isfinite(row["loss"]):
        raise FloatingPointError(f"loss is {row['loss']} at step {done}; lower "
                                 "optimizer.learning_rate or check the data")
    return row


def _run_steps(run: TrainSetup, state: TrainState, start: int, end: int) -> dict[str, Any]:
    """Steps ``start`` .. ``end`` - 1: log every log_every, evaluate every eval_every, checkpoint
    every save_every (and all three at ``end``). Returns losses (one per step), the last train
    and eval rows, and the seconds taken."""
    from tqdm import tqdm

    cfg, out_dir = run.cfg, run.out_dir
    writer = MetricsWriter(out_dir / METRICS_FILE, resume_step=start if run.resumed else None)
    schedule = cfg.optimizer.schedule()
    losses: list[jax.Array] = []
    last_train: dict[str, Any] | None = None
    last_eval: dict[str, Any] | None = None
    tokens_since, t_last, t_start = 0, time.perf_counter(), time.perf_counter()
    # Totals carried over resumes (a head's card reports the whole run's tokens and wall time).
    before = [r for r in read_metrics(writer.path) if r.get("kind") == "train"
              and r.get("step", 0) <= start] if run.resumed else []
    tokens_total = int(before[-1].get("tokens", 0)) if before else 0
    seconds_before = float(before[-1].get("seconds", 0.0)) if before else 0.0

    bar = tqdm(total=end, initial=start, disable=not cfg.progress or jax.process_index() != 0,
               desc="train", unit="step", dynamic_ncols=True)
    for step in range(start, end):
        try:
            host = next(run.data_iter)
        except StopIteration:
            raise ConfigError("the training data ran out; make_train_iterator should repeat "
                              "forever (num_epochs=None)") from None
        tokens_since += int(np.count_nonzero(host["segment_ids"]))
        batch = _global_batch(host, run.batch_sh, (cfg.grad_accum,), cfg.batch_size)
        state, metrics = run.step_fn(state, run.frozen, run.vocab, batch)
        losses.append(metrics["loss"])
        done = step + 1

        if done % cfg.log_every == 0 or done == end:
            now = time.perf_counter()
            tokens_per_s = tokens_since * jax.process_count() / max(now - t_last, 1e-9)
            tokens_total += tokens_since * jax.process_count()
            tokens_since, t_last = 0, now
            last_train = _train_row(jax.device_get(metrics), done, float(schedule(step)),
                                    tokens_per_s)
            last_train.update(tokens=tokens_total,
                              seconds=round(seconds_before + now - t_start, 3))
            writer.write(last_train)
            bar.set_postfix(loss=f"{last_train['loss']:.3f}",
                            acc="/".join(f"{a:.2f}" for a in last_train["acc_per_step"][:4]))
        if done % cfg.eval_every == 0 or done == end:
            last_eval = evaluate(run, state.params)
            if last_eval is not None:
                writer.write({"kind": "eval", "step": done, **last_eval})
                bar.write(f"eval @ {done}: loss {last_eval['loss']:.3f}, acc "
                          + " ".join(f"{a:.2f}" for a in last_eval["acc_per_step"])
                          + f", simulated tau {last_eval['accept_length']:.2f}")
            if jax.process_index() == 0:
                plot_accuracy(read_metrics(writer.path), out_dir / PLOT_FILE)
        if done % cfg.save_every == 0 or done == end:
            run.ckpt.save(done, state, run.data_iter, run.metadata)
        bar.update(1)
    bar.close()
    if start == end and jax.process_index() == 0:
        plot_accuracy(read_metrics(writer.path), out_dir / PLOT_FILE)
    return {"losses": [float(x) for x in jax.device_get(losses)], "train": last_train,
            "eval": last_eval, "elapsed_s": time.perf_counter() - t_start}


def train(
    cfg: TrainConfig,
    *,
    max_steps: int | None = None,
    target_override: TargetOverride | None = None,
    train_records: Sequence | None = None,
    eval_records: Sequence | None = None,
) -> dict[str, Any]:
    """Train (or resume) a draft head as ``cfg`` says.

    Args:
      cfg: the run config; ``cfg.out_dir`` holding checkpoints means resume.
      max_steps: stop once the global step reaches this (a checkpoint is written there), as if
        the job were pre-empted; None runs to ``cfg.total_steps``.
      target_override: an in-memory target instead of ``cfg.target``.
      train_records / eval_records: random-access sequences of {input_ids, loss_mask} instead of
        ``cfg.train_data`` / ``cfg.eval_data`` (online mode only).
    Raises:
      ConfigError: a bad config or a path in it that does not exist (before anything loads);
        DataError, CheckpointError, TrainCheckpointError: unreadable inputs or checkpoints.
    Returns:
      summary dict: start_step, end_step, losses (one per step run here), last train metrics,
      last eval metrics (with accept_length), out_dir, checkpoint steps, elapsed seconds.
    """
    check_inputs(cfg, target_override=target_override, train_records=train_records,
                 eval_records=eval_records)
    run, state = _setup(cfg, target_override, train_records, eval_records)
    start = int(jax.device_get(state.step))
    end = min(cfg.total_steps, max_steps) if max_steps is not None else cfg.total_steps
    result = _run_steps(run, state, start, end)
    steps = run.ckpt.all_steps()
    run.ckpt.close()
    return {"start_step": start, "end_step": end, "losses": result["losses"],
            "train": result["train"], "eval": result["eval"], "out_dir": str(run.out_dir),
            "checkpoint_steps": steps, "elapsed_s": result["elapsed_s"],
            "draft_config": run.draft_cfg}
