"""Training metrics: one JSON object per line, and a PNG of per-step accuracy over training.

Records (``metrics.jsonl`` in the run folder)::

    {"kind": "train", "step": 120, "loss": ..., "loss_per_step": [K], "acc_per_step": [K],
     "grad_norm": ..., "lr": ..., "tokens_per_s": ..., "tokens": ..., "seconds": ...}
    {"kind": "eval", "step": 500, "loss": ..., "loss_per_step": [K], "acc_per_step": [K],
     "hits_per_step": [K][R], "accept_length": ...}

``tokens`` and ``seconds``: tokens trained on and wall seconds spent since the run began
(summed over resumes). ``hits_per_step[k][r]``: the share of held-out positions at TTT step k (tree depth k + 1) whose
target token is among the draft's r + 1 best (so ``[k][0]`` is ``acc_per_step[k]``); the tree
chooser models a tree's acceptance from it (``eagle3_jax.decoding.acceptance``).

``accept_length`` is the simulated acceptance length ``1 + sum_k prod_{i<=k} acc_i`` of a chain
of K drafts (``eagle3_jax.decoding.acceptance.chain_accept_length``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from eagle3_jax.draft.load import read_metrics  # noqa: F401  (shared with the head loader)


def _plain(value: Any) -> Any:
    """numpy / jax scalars and arrays -> JSON-able floats and lists."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "shape"):
        arr = np.asarray(value)
        return arr.tolist() if arr.ndim else arr.item()
    return value


class MetricsWriter:
    """Appends JSON lines to ``path``; on resume, drops records past the restored step."""

    def __init__(self, path: str | Path, *, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            # A killed run may have logged steps its last checkpoint does not hold; the resumed
            # run logs them again.
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: Mapping[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(_plain(dict(record))) + "\n")


def plot_accuracy(records: Iterable[Mapping[str, Any]], png_path: str | Path) -> Path | None:
    """Per-TTT-step top-1 accuracy against the training step: train (left), eval (right).

    Returns the path written, or None when there is nothing to plot yet.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = list(records)
    panels = [(kind, [r for r in records if r.get("kind") == kind and r.get("acc_per_step")])
              for kind in ("train", "eval")]
    panels = [(kind, rs) for kind, rs in panels if rs]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (kind, rs) in zip(axes[0], panels):
        steps = [r["step"] for r in rs]
        acc = np.array([r["acc_per_step"] for r in rs])  # [points, K]
        for k in range(acc.shape[1]):
            ax.plot(steps, acc[:, k], marker="o" if len(steps) < 30 else None, ms=3,
                    label=f"step {k}")
        title = f"{kind} per-step accuracy"
        if kind == "eval" and "accept_length" in rs[-1]:
            title += f" (simulated tau {rs[-1]['accept_length']:.2f})"
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.set_ylabel("top-1 accuracy vs target")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    png_path = Path(png_path)
    tmp = png_path.with_name(png_path.stem + ".part.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(png_path)
    return png_path
