"""One loader for every form a draft head comes in: ``load_head(path, target_cfg)``.

``path`` is one of:

* a released-format head folder (``config.json`` + ``model.safetensors`` or
  ``pytorch_model.bin``; :func:`eagle3_jax.draft.export.load_draft_head`);
* a training run folder (``out_dir`` of ``python -m eagle3_jax.train``), its ``checkpoints/``
  folder, or one ``checkpoints/<step>`` folder.

A training run folder, as the trainer writes it::

    out_dir/
        checkpoints/<step>/state/   orbax TrainState: {params, opt_state, step, rng}
        checkpoints/<step>/meta/    JSON: draft_config, train_config, draft_vocab_file, ...
        draft_vocab.npz             d2t / t2d (absent for an identity vocabulary)
        metrics.jsonl               train / eval records, with per-TTT-step ``acc_per_step``

Only the ``params`` subtree of the state is read (an orbax partial restore), so reading a head
needs neither the optimiser nor the trainer. The head's measured per-depth acceptance rates are
the run's latest eval ``hits_per_step`` (top-r hit rates per depth) at or before the step, else
its latest eval (else train) ``acc_per_step``. A released-format folder may carry the same
record as ``acceptance.json`` (``python -m eagle3_jax.export`` writes it from the run).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.params import DraftHead, VocabMap, draft_param_specs
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.model.config import ConfigError, TargetConfig
from eagle3_jax.model.params import is_spec

CHECKPOINT_DIR = "checkpoints"
VOCAB_FILE = "draft_vocab.npz"
METRICS_FILE = "metrics.jsonl"
ACCEPTANCE_FILE = "acceptance.json"  # in a released-format folder: the eval record it came from
STATE_ITEM, DATA_ITEM, META_ITEM = "state", "data", "meta"


class HeadError(Eagle3Error, ValueError):
    """A draft head path that is missing or unreadable; the message names it and the fix."""


@dataclasses.dataclass(frozen=True)
class LoadedHead:
    """A head ready to decode with, and what is known about it.

    accept_rates: measured per-depth rates (a training run's eval): per depth the top-r hit
      rates [h(1), ..., h(R)], or the top-1 rate alone for older runs; None if unknown.
    accept_scale, accept_decay: the live calibration (``acceptance.json``'s ``"live"``, written
      by ``python -m eagle3_jax.bench calibrate --write``): a node at draft level l is credited
      with ``accept_scale * accept_decay**l`` of its modelled acceptance
      (:func:`eagle3_jax.decoding.calibration.fit_live_scale`); None and 1 if unknown.
    step, run_dir: the training step and run folder it was read from (None for a
      released-format folder).
    """

    head: DraftHead
    description: str
    accept_rates: list[float] | list[list[float]] | None = None
    accept_scale: float | None = None
    accept_decay: float = 1.0
    step: int | None = None
    run_dir: Path | None = None

    def serving(self) -> "LoadedHead":
        """The same, its head in the serving layout decoding runs (``DraftHead.serving``):
        converted once here, so the decoder and the autotune's timings do not each convert."""
        return dataclasses.replace(self, head=self.head.serving())


def check_head_path(path: str | Path) -> Path:
    """``path`` as a Path if it exists, else the snapshot folder of the Hugging Face hub id it
    names (:mod:`eagle3_jax.checkpoints.hub`), else a :class:`HeadError` (checked before any
    load)."""
    from eagle3_jax.checkpoints.hub import HEAD_FILES, HubError, is_hub_id, resolve_hub_id

    folder = Path(path)
    if folder.exists():
        return folder
    if is_hub_id(str(path)):
        try:
            return resolve_hub_id(str(path), HEAD_FILES)
        except HubError as e:
            raise HeadError(f"draft head {str(path)!r} is no folder, and as a hub id: "
                            f"{e}") from None
    raise HeadError(f"draft head {str(path)!r} does not exist; give a released EAGLE-3 head "
                    "folder (config.json + model.safetensors), a training run folder or a "
                    "Hugging Face hub id (org/name)")


def load_head(path: str | Path, target_cfg: TargetConfig | None = None, *,
              step: int | None = None) -> LoadedHead:
    """Read the head at ``path`` (see module docstring); checks it fits ``target_cfg``.

    ``step`` picks a training checkpoint (default: the one named by the path, else the latest).
    Raises HeadError / DraftExportError naming the path, ConfigError when it does not fit.
    """
    folder = check_head_path(path)
    if (folder / "config.json").is_file():
        from eagle3_jax.draft.export import load_draft_head

        # Stored in 16-bit or not, a head computes in its target's dtype.
        dtype = target_cfg.dtype if target_cfg is not None else None
        rates, scale, decay = _released_acceptance(folder / ACCEPTANCE_FILE)
        return LoadedHead(load_draft_head(folder, target_cfg, dtype=dtype),
                          f"released-format head {folder}", accept_rates=rates,
                          accept_scale=scale, accept_decay=decay)
    run_dir, named_step = _run_folder(folder, path)
    head, step = read_run_head(run_dir, step if step is not None else named_step)
    if target_cfg is not None:
        head.cfg.check_fits(target_cfg)
    return LoadedHead(head, f"training run {run_dir} step {step}",
                      accept_rates=_measured_rates(run_dir / METRICS_FILE, step), step=step,
                      run_dir=run_dir)


def _run_folder(folder: Path, path) -> tuple[Path, int | None]:
    """(run folder, the step the path names or None)."""
    if folder.name.isdigit() and folder.parent.name == CHECKPOINT_DIR:
        return folder.parent.parent, int(folder.name)
    if folder.name == CHECKPOINT_DIR:
        folder = folder.parent
    if not (folder / CHECKPOINT_DIR).is_dir():
        raise HeadError(f"draft head {str(path)!r} is neither a released EAGLE-3 head folder "
                        f"(config.json + model.safetensors) nor a training run folder "
                        f"({CHECKPOINT_DIR}/)")
    return folder, None


def run_steps(run_dir: Path) -> list[int]:
    """The complete checkpoint steps of a run (orbax renames a step folder once it is whole)."""
    root = run_dir / CHECKPOINT_DIR
    return sorted(int(p.name) for p in root.iterdir()
                  if p.name.isdigit() and (p / META_ITEM).is_dir()) if root.is_dir() else []


def read_run_head(run_dir: str | Path, step: int | None = None) -> tuple[DraftHead, int]:
    """(DraftHead of a training run's checkpoint, its step); the latest step by default.

    Params come back on the first local device.
    """
    import orbax.checkpoint as ocp

    run_dir = Path(run_dir).absolute()  # orbax reads absolute paths only
    steps = run_steps(run_dir)
    if not steps:
        raise HeadError(f"no checkpoint in {run_dir / CHECKPOINT_DIR}; train first, or pass a "
                        "run folder that has checkpoints/<step>/")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise HeadError(f"no checkpoint for step {step} in {run_dir / CHECKPOINT_DIR}; "
                        f"available steps: {steps}")
    step_dir = run_dir / CHECKPOINT_DIR / str(step)
    try:
        meta = json.loads((step_dir / META_ITEM / "metadata").read_text())
        draft_cfg = DraftConfig.from_dict(meta["draft_config"])
    except (OSError, ValueError, KeyError, ConfigError) as e:
        raise HeadError(f"{step_dir}: unreadable run metadata ({type(e).__name__}: {e})") from None
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    dtype = jnp.dtype(draft_cfg.dtype)
    abstract = {"params": jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, dtype, sharding=device),
        draft_param_specs(draft_cfg), is_leaf=is_spec)}
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            step_dir / STATE_ITEM, args=ocp.args.PyTreeRestore(
                item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                partial_restore=True))
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
        raise HeadError(f"checkpoint {step_dir} is corrupt or incomplete ({type(e).__name__}: "
                        f"{str(e)[:300]})") from e
    vocab_file = meta.get("draft_vocab_file")
    vocab = (VocabMap.identity(draft_cfg.vocab_size) if vocab_file is None
             else read_vocab_file(run_dir / vocab_file))
    return DraftHead(params=restored["params"], vocab=vocab, cfg=draft_cfg), step


def read_vocab_file(path: str | Path) -> VocabMap:
    """The VocabMap of a draft-vocabulary ``.npz`` (``d2t`` [Vd] offsets, ``t2d`` [V] bool)."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            d2t, t2d = z["d2t"].astype(np.int64), z["t2d"].astype(bool)
    except (OSError, KeyError, ValueError) as e:
        raise HeadError(f"{path}: not a draft vocabulary .npz ({type(e).__name__}: {e})") from None
    return VocabMap.from_used_ids(d2t + np.arange(len(d2t)), len(t2d))


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a metrics JSONL file (a torn last line is skipped; no file -> [])."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def latest_eval(metrics_path: str | Path, step: int | None = None) -> dict | None:
    """The run's latest eval record at or before ``step`` (any step if None), or None."""
    found = [r for r in read_metrics(metrics_path) if r.get("kind") == "eval"
             and r.get("acc_per_step") and (step is None or r.get("step", 0) <= step)]
    return found[-1] if found else None


def rates_of(record: dict) -> list[float] | list[list[float]]:
    """A metrics record's per-depth rates: ``hits_per_step`` if it has them, else
    ``acc_per_step``."""
    if record.get("hits_per_step"):
        return [[float(h) for h in hits] for hits in record["hits_per_step"]]
    return [float(a) for a in record["acc_per_step"]]


def _measured_rates(metrics_path: Path, step: int) -> list[float] | list[list[float]] | None:
    """The rates of the latest eval (else train) record at or before ``step``, or None."""
    record = latest_eval(metrics_path, step)
    if record is None:
        train = [r for r in read_metrics(metrics_path) if r.get("kind") == "train"
                 and r.get("acc_per_step") and r.get("step", 0) <= step]
        record = train[-1] if train else None
    return None if record is None else rates_of(record)


def _released_acceptance(path: Path) -> tuple[list[float] | list[list[float]] | None,
                                              float | None, float]:
    """(rates, live scale, level decay) of a released folder's ``acceptance.json``
    (:func:`eagle3_jax.decoding.calibration.live_level_scale` of its ``"live"`` record); None /
    1 for what is absent or unreadable (the chooser then falls back to its default profile or
    takes the rates as they are, and says which)."""
    from eagle3_jax.decoding.calibration import live_level_scale

    try:
        record = json.loads(path.read_text())
        rates = rates_of(record)
    except (OSError, ValueError, KeyError, TypeError):
        return None, None, 1.0
    try:
        return (rates, *live_level_scale(record["live"], rates))
    except (KeyError, TypeError, ValueError, AttributeError):
        return rates, None, 1.0
