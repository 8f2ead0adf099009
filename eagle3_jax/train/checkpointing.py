"""Training checkpoints: TrainState, the data iterator and the run's configs, saved together.

One orbax ``CheckpointManager`` step folder per save::

    out_dir/checkpoints/<step>/
        state/      TrainState (params, optimiser state, step, raw RNG key data), sharded arrays
        data/       the grain iterator position (grain.checkpoint.CheckpointHandler), per process
        meta/       JSON: draft config, train config, target config, step

Orbax writes a step into a temporary folder and renames it once complete, so a save killed
midway leaves no step folder and the previous checkpoint stays the latest; ``max_to_keep`` keeps
the newest N. Restoring takes an abstract TrainState (``jax.eval_shape`` + shardings), so arrays
come back already placed on the mesh. Anything unreadable raises :class:`TrainCheckpointError`
naming the folder and what to do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grain
import grain.checkpoint  # noqa: F401  (registers CheckpointSave/Restore with orbax)
import jax
import orbax.checkpoint as ocp

from eagle3_jax.errors import Eagle3Error
from eagle3_jax.draft.load import DATA_ITEM as DATA
from eagle3_jax.draft.load import META_ITEM as META
from eagle3_jax.draft.load import STATE_ITEM as STATE
from eagle3_jax.train.step import TrainState



class TrainCheckpointError(Eagle3Error, RuntimeError):
    """A training checkpoint that is missing or unreadable; the message names folder and fix."""


def _to_saveable(state: TrainState) -> TrainState:
    """Typed PRNG keys cannot be serialised; store their raw uint32 data."""
    if jax.dtypes.issubdtype(state.rng.dtype, jax.dtypes.prng_key):
        return state.replace(rng=jax.random.key_data(state.rng))
    return state


def abstract_state(state_shapes: TrainState, shardings: TrainState) -> TrainState:
    """ShapeDtypeStructs (raw key data for the RNG) carrying ``shardings``, to restore onto."""
    saveable = jax.eval_shape(_to_saveable, state_shapes)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        saveable, shardings)


class TrainCheckpointer:
    """Save and restore (TrainState, data iterator, metadata) under ``directory``."""

    def __init__(self, directory: str | Path, *, max_to_keep: int = 3):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False,
            cleanup_tmp_directories=True,
        )
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options,
                                                  item_names=(STATE, DATA, META))
        except Exception as e:  # noqa: BLE001 - orbax raises many types
            raise TrainCheckpointError(
                f"cannot open checkpoint folder {self.directory}: {e}. Check the path is "
                "writable, or choose another out_dir.") from e

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: TrainState, data_iter: Any | None,
             metadata: dict[str, Any]) -> None:
        """Save synchronously (returns once the step folder is complete and renamed)."""
        items = {STATE: ocp.args.StandardSave(_to_saveable(state)),
                 META: ocp.args.JsonSave(dict(metadata, step=int(step)))}
        if data_iter is not None:
            items[DATA] = grain.checkpoint.CheckpointSave(data_iter)
        self._manager.save(int(step), args=ocp.args.Composite(**items), force=True)
        self._manager.wait_until_finished()

    def read_metadata(self, step: int | None = None) -> dict[str, Any]:
        step = self.resolve_step(step)
        path = self._step_dir(step) / META / "metadata"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise self._corrupt(step, e) from e

    def restore(self, abstract: TrainState, data_iter: Any | None = None,
                step: int | None = None, *, typed_rng: bool = True) -> tuple[TrainState, dict]:
        """Restore onto ``abstract`` (from :func:`abstract_state`); ``data_iter`` is set in place.

        Returns (state, metadata).
        """
        step = self.resolve_step(step)
        items = {STATE: ocp.args.StandardRestore(abstract), META: ocp.args.JsonRestore()}
        if data_iter is not None:
            items[DATA] = grain.checkpoint.CheckpointRestore(data_iter)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
            raise self._corrupt(step, e) from e
        state = restored[STATE]
        if typed_rng:
            state = state.replace(rng=jax.random.wrap_key_data(state.rng))
        return state, dict(restored[META])

    def close(self) -> None:
        self._manager.close()

    # -----------------------------------------------------------------------------------------

    def resolve_step(self, step: int | None = None) -> int:
        """``step`` if saved (default: the latest); TrainCheckpointError otherwise."""
        steps = self.all_steps()
        if not steps:
            raise TrainCheckpointError(f"no checkpoint in {self.directory}; train first, or point "
                                  "--checkpoint at a run folder that has checkpoints/<step>/")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise TrainCheckpointError(f"no checkpoint for step {step} in {self.directory}; "
                                  f"available steps: {steps}")
        return int(step)

    def _step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def _corrupt(self, step: int, error: Exception) -> TrainCheckpointError:
        older = [s for s in self.all_steps() if s < step]
        fix = (f"delete {self._step_dir(step)} to resume from step {older[-1]}" if older
               else f"delete {self.directory} to start over")
        return TrainCheckpointError(f"checkpoint {self._step_dir(step)} is corrupt or incomplete "
                               f"({type(error).__name__}: {str(error)[:300]}); {fix}")
