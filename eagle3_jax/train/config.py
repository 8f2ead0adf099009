"""The training-run config: one frozen dataclass, read from YAML with ``key=value`` overrides.

A file (``configs/train-*.yaml``) holds the fields of :class:`TrainConfig`; ``optimizer`` and
``mesh`` are nested mappings of :class:`OptimizerConfig` (minus ``total_steps``, which is the
run's ``total_steps``) and :class:`MeshConfig`. Overrides use dotted keys for nesting::

    python -m eagle3_jax.train --config configs/train-smollm2-135m.yaml \\
        total_steps=200 optimizer.learning_rate=3e-4 mesh.data=2

Values are parsed as YAML scalars, then coerced to the field's type (``3e-4`` is a float for a
float field, ``null`` clears an optional field). Unknown keys and bad values raise
:class:`ConfigError` naming the key. :func:`check_paths` checks, in milliseconds and before
anything loads, that the target and every file or folder the config names exist.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

import optax
import yaml

from eagle3_jax.draft.ttt import LOSS_MASK_OFFSETS, OBJECTIVES
from eagle3_jax.model.config import ConfigError
from eagle3_jax.sharding import MeshConfig, MeshError

_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warm-up and cosine decay; clip by global norm (reference §4)."""

    learning_rate: float = 1e-4
    warmup_steps: int = 100
    total_steps: int = 10000
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    min_lr_ratio: float = 0.0

    def schedule(self) -> optax.Schedule:
        """Learning rate by step: linear warm-up to the peak, cosine decay to the end."""
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=self.learning_rate,
            warmup_steps=max(self.warmup_steps, 1),
            decay_steps=max(self.total_steps, self.warmup_steps + 1),
            end_value=self.learning_rate * self.min_lr_ratio,
        )

    def build(self) -> optax.GradientTransformation:
        return optax.chain(
            optax.clip_by_global_norm(self.grad_clip),
            optax.adamw(self.schedule(), b1=self.b1, b2=self.b2,
                        weight_decay=self.weight_decay),
        )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a draft-head training run needs.

    target: a preset name, a checkpoint path (HF folder / GGUF), a Hugging Face hub id
      (``org/name``, through the hub cache), or ``random:<preset>`` (the
      preset's architecture with random weights, for smoke tests).
    train_data / eval_data: tokenised record files (``eagle3_jax.data``); with no eval_data,
      ``eval_fraction`` of the training records is held out.
    train_features / eval_features: offline mode. A features folder written by
      ``python -m eagle3_jax.data features`` (the target's taps and final hidden states per
      token, ``eagle3_jax.data.features``). When train_features is set the run trains from it
      instead of running the target: train_data / eval_data are not read, the target is loaded
      only for its embedding table and output head (the rest is freed), the features must have
      been made by this target (hidden size, tap layers, vocabulary: checked), and with no
      eval_features ``eval_fraction`` of the training features is held out. Batching, packing,
      shuffling and exact resume work as online; from float32 features the losses equal an
      online run's up to float32 round-off. eval_features needs train_features.
    draft_vocab: a draft-vocabulary file (d2t/t2d); None -> identity when draft_vocab_size
      equals the target vocabulary, else built from the training records (or the training
      features' input_ids / loss_mask).
    init_head: a released-format head folder, or ``builtin:NAME`` (a shipped head): a *new*
      run starts from its weights and draft vocabulary (optimiser state fresh, step 0), so
      training can continue from a committed head after the run folder is gone. It must have
      this run's architecture; draft_vocab, if set too, must be the same vocabulary. A run that
      resumes from its own checkpoint ignores it.
    batch_size: global sequences per micro-batch; each optimiser step sees grad_accum of them.
    """

    target: str = "smollm2-135m"
    target_sharding: str = "serving"  # rules for the frozen target: "serving" or "training"
    train_data: str | None = None
    eval_data: str | None = None
    eval_fraction: float = 0.02
    train_features: str | None = None  # offline mode: a features folder (see above)
    eval_features: str | None = None
    draft_vocab: str | None = None
    init_head: str | None = None  # start a new run from this head's weights (see above)
    draft_vocab_size: int = 32000
    max_len: int = 2048
    batch_size: int = 8
    grad_accum: int = 1
    pack: bool = True
    shuffle: bool = True
    ttt_steps: int = 7
    optimizer: OptimizerConfig = OptimizerConfig()
    mesh: MeshConfig = MeshConfig()
    seed: int = 0
    out_dir: str = "runs/eagle3"
    total_steps: int = 10000
    save_every: int = 500
    keep_checkpoints: int = 3
    eval_every: int = 500
    eval_batches: int = 8
    log_every: int = 10
    dtype: str = "float32"  # the target's parameter dtype (the draft's master weights: float32)
    compute_dtype: str | None = None  # the draft's compute dtype; None = dtype
    loss_mask: str = "predicted"  # "predicted" or "reference" (eagle3_jax.draft.ttt)
    objective: str = "kl"  # per-position loss: "kl" (reference) or "lk" (eagle3_jax.draft.ttt)
    fc_norm: bool = False  # EAGLE-3.1: per-tap RMSNorm before fc (eagle3_jax.draft.config)
    norm_output: bool = False  # EAGLE-3.1: the normed output is the next step's feature
    progress: bool = True  # tqdm progress bar

    def __post_init__(self):
        # The LR schedule decays over the run's own length.
        if self.optimizer.total_steps != self.total_steps:
            object.__setattr__(self, "optimizer",
                               dataclasses.replace(self.optimizer, total_steps=self.total_steps))
        positive = ("draft_vocab_size", "max_len", "batch_size", "grad_accum", "ttt_steps",
                    "total_steps", "save_every", "keep_checkpoints", "eval_every", "log_every")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"train config: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.eval_batches, int) or self.eval_batches < 0:
            raise ConfigError(f"train config: eval_batches must be >= 0, got {self.eval_batches!r}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"train config: eval_fraction must be in [0, 1), "
                              f"got {self.eval_fraction!r}")
        if self.loss_mask not in LOSS_MASK_OFFSETS:
            raise ConfigError("train config: loss_mask must be 'predicted' (the mask of the "
                              "token each step predicts) or 'reference' (the reference "
                              f"implementation's alignment), got {self.loss_mask!r}")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"train config: objective must be one of {list(OBJECTIVES)} "
                              f"('kl': cross-entropy as the reference; 'lk': the LK hybrid), "
                              f"got {self.objective!r}")
        if self.target_sharding not in ("serving", "training"):
            raise ConfigError("train config: target_sharding must be 'serving' or 'training', "
                              f"got {self.target_sharding!r}")
        for name in ("dtype", "compute_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _DTYPES:
                raise ConfigError(f"train config: {name} must be one of {_DTYPES}, got {value!r}")
        opt = self.optimizer
        if not opt.learning_rate > 0:
            raise ConfigError(f"train config: optimizer.learning_rate must be > 0, "
                              f"got {opt.learning_rate!r}")
        if opt.warmup_steps < 0 or opt.grad_clip <= 0 or opt.weight_decay < 0:
            raise ConfigError("train config: optimizer needs warmup_steps >= 0, grad_clip > 0, "
                              f"weight_decay >= 0; got {opt}")
        if not (0 <= opt.b1 < 1 and 0 <= opt.b2 < 1 and 0 <= opt.min_lr_ratio <= 1):
            raise ConfigError(f"train config: optimizer b1, b2 must be in [0, 1) and min_lr_ratio "
                              f"in [0, 1]; got {opt}")
        if self.eval_features is not None and self.train_features is None:
            raise ConfigError("train config: eval_features is set but train_features is not; "
                              "offline training needs both from the same target (or only "
                              "train_features, holding out eval_fraction)")
        if not self.out_dir:
            raise ConfigError("train config: out_dir must be set")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.max_len

    @property
    def draft_compute_dtype(self) -> str:
        """The dtype the draft computes in: compute_dtype, else the target's dtype."""
        return self.compute_dtype or self.dtype

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["optimizer"].pop("total_steps")
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "train config") -> "TrainConfig":
        """Build from a (nested) mapping, coercing values to the field types."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source} must be a mapping of TrainConfig fields")
        kwargs = _coerce_fields(cls, data, source, prefix="")
        try:
            return cls(**kwargs)
        except MeshError as e:
            raise ConfigError(f"{source}: mesh: {e}") from None


def load_train_config(path: str | Path | None = None,
                      overrides: Sequence[str] = ()) -> TrainConfig:
    """A YAML train config (defaults when ``path`` is None) with ``key=value`` overrides.

    ``path`` is a file, or the name of a shipped config (``train-smollm2-135m``, see
    :func:`eagle3_jax.presets.train_config_path`).
    """
    from eagle3_jax.presets import train_config_path

    data: dict[str, Any] = {}
    source = "train config"
    if path is not None:
        path = train_config_path(path)
        source = str(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{source} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{source} must hold a mapping of TrainConfig fields")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value (dotted keys nest, "
                              "e.g. optimizer.learning_rate=3e-4)")
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a nested section")
            node = child
        node[parts[-1]] = value
    return TrainConfig.from_dict(data, source)


# ---------------------------------------------------------------------------------------------
# The inputs a run reads: checked before anything heavy loads.

RECORDS_HINT = "a tokenised .npz/.jsonl from `python -m eagle3_jax.data prepare`"
FEATURES_HINT = "a folder from `python -m eagle3_jax.data features`"


def check_paths(cfg: TrainConfig, *, skip: Collection[str] = ()) -> None:
    """Raise ConfigError, naming the key as the user types it (``target=``, ``train_data=``),
    unless every input the run will read exists: ``target`` resolves (a preset with weights, an
    existing path, or ``random:<preset>``), the record files / features folders and the
    draft-vocabulary file exist, and ``out_dir`` is not a file.

    Only existence is checked (milliseconds), not contents: the loaders still report a bad file.
    ``skip``: keys this run does not read (an in-memory target or records, a draft vocabulary the
    run folder already holds). Offline runs (train_features set) do not read train_data /
    eval_data.
    """
    if "target" not in skip:
        _check_target(cfg.target)
    if cfg.train_features is not None:
        for key in ("train_features", "eval_features"):
            _check_features_dir(key, getattr(cfg, key))
    else:
        if cfg.train_data is None and "train_data" not in skip:
            raise ConfigError(f"train config: set train_data= ({RECORDS_HINT}) or "
                              f"train_features= ({FEATURES_HINT})")
        for key in ("train_data", "eval_data"):
            if key not in skip:
                _check_file(key, getattr(cfg, key), RECORDS_HINT)
    if "draft_vocab" not in skip:
        _check_file("draft_vocab", cfg.draft_vocab,
                    "a vocabulary .npz from `python -m eagle3_jax.data vocab`, or null to build one")
    if cfg.init_head is not None and init_head_path(cfg.init_head) is None:
        raise ConfigError(f"train config: init_head={cfg.init_head!r} is neither a released "
                          "EAGLE-3 head folder (config.json + model.safetensors) nor a shipped "
                          "head (builtin:NAME); set init_head= to one, or null")
    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train config: out_dir={cfg.out_dir!r} is a file; set out_dir= to a "
                          "folder (new, or a run's folder to resume it)")


def _check_file(key: str, value: str | None, hint: str) -> None:
    if value is not None and not Path(value).is_file():
        what = "is a folder, not a file" if Path(value).is_dir() else "does not exist"
        raise ConfigError(f"train config: {key}={value!r} {what}; set {key}= to {hint}")


def _check_features_dir(key: str, value: str | None) -> None:
    from eagle3_jax.data.features import MANIFEST

    if value is None:
        return
    path = Path(value)
    if not path.is_dir():
        raise ConfigError(f"train config: {key}={value!r} does not exist; set {key}= to "
                          f"{FEATURES_HINT}")
    if not (path / MANIFEST).is_file():
        raise ConfigError(f"train config: {key}={value!r} holds no {MANIFEST}; set {key}= to "
                          f"{FEATURES_HINT}")


def _check_target(target: str) -> None:
    """``target`` as ``train/loop.py: load_frozen_target`` and ``load_target`` resolve it."""
    from eagle3_jax.checkpoints.hub import TARGET_FILES, HubError, is_hub_id, resolve_hub_id
    from eagle3_jax.presets import PresetError, list_presets, load_preset

    if target.startswith("random:"):
        try:
            load_preset(target[len("random:"):])
        except PresetError as e:
            raise ConfigError(f"train config: target={target!r}: {e}") from None
        return
    if Path(target).exists():
        return  # a checkpoint folder, GGUF or preset file; its loader judges the contents
    presets = list_presets()
    if target in presets:
        if load_preset(target).weights is None:
            raise ConfigError(f"train config: target={target!r} is a preset without weights; "
                              "set target= to its HF checkpoint folder, hub id or .gguf file")
        return
    if is_hub_id(target):  # fetched now (unless offline), before anything loads
        try:
            resolve_hub_id(target, TARGET_FILES)
        except HubError as e:
            raise ConfigError(f"train config: target={target!r} is no path and no preset, and "
                              f"as a hub id: {e}") from None
        return
    close = difflib.get_close_matches(target, presets, n=1)
    hint = f" (did you mean target={close[0]}?)" if close else ""
    raise ConfigError(f"train config: target={target!r} is neither a preset nor an existing "
                      f"path{hint}; set target= to a preset ({', '.join(presets)}), an HF "
                      "checkpoint folder, a Hugging Face hub id (org/name), a .gguf file, or "
                      "random:<preset>")


# ---------------------------------------------------------------------------------------------


def _coerce_fields(cls, data: Mapping[str, Any], source: str, prefix: str) -> dict[str, Any]:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    allowed = set(fields)
    if cls is OptimizerConfig:
        allowed.discard("total_steps")  # set by the run's total_steps
    unknown = sorted(set(data) - allowed)
    if unknown:
        where = f" in {prefix.rstrip('.')}" if prefix else ""
        raise ConfigError(f"{source}: unknown key(s) {[prefix + u for u in unknown]}{where}; "
                          f"known: {sorted(allowed)}")
    out = {}
    for name, value in data.items():
        hint = hints[name]
        key = prefix + name
        if dataclasses.is_dataclass(hint):
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"{source}: {key} must be a mapping of {hint.__name__} fields, "
                                  f"got {value!r}")
            try:
                out[name] = hint(**_coerce_fields(hint, value, source, key + "."))
            except (MeshError, ConfigError) as e:
                raise ConfigError(f"{source}: {key}: {e}") from None
        else:
            out[name] = _coerce(hint, value, key, source)
    return out


def _coerce(hint: Any, value: Any, key: str, source: str) -> Any:
    args = typing.get_args(hint)
    optional = (typing.get_origin(hint) in (typing.Union, types.UnionType)
                and type(None) in args)
    if optional:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    bad = ConfigError(f"{source}: {key} must be {getattr(hint, '__name__', hint)}"
                      f"{' or null' if optional else ''}, got {value!r}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise bad
    if hint is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, (int, str)):
            raise bad
        try:
            return int(value)
        except ValueError:
            raise bad from None
    if hint is float:
        if isinstance(value, bool):
            raise bad
        try:
            return float(value)  # YAML 1.1 reads "3e-4" as a string
        except (TypeError, ValueError):
            raise bad from None
    if hint is str:
        if isinstance(value, (dict, list)) or value is None:
            raise bad
        return str(value)
    return value


def init_head_path(value: str) -> Path | None:
    """The folder ``init_head`` names (a path, or builtin:NAME), or None if there is none."""
    from eagle3_jax.draft.shipped import builtin_head_path
    from eagle3_jax.presets import BUILTIN_PREFIX

    if value.startswith(BUILTIN_PREFIX):
        return builtin_head_path(value)
    folder = Path(value)
    return folder if (folder / "config.json").is_file() else None
