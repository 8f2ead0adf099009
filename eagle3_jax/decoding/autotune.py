"""Pick the draft tree (tree_top_k, depth, total_tokens) that maximises expected tokens/s here.

The model (batch 1, greedy)::

    tokens/s(tree) = E[tau](tree) / (t_target(total_tokens) + t_draft(depth, tree_top_k))

* ``t_target(T)``: measured seconds of one target forward over T new tokens after ``context``
  cached tokens (:func:`eagle3_jax.decoding.costs.forward_curve`), T in 1, 2, 4, ..., 64;
  linear in between.
  T = 1 is plain decoding's step, so plain tokens/s = 1 / t_target(1).
* ``t_draft(depth, k) = (depth - 1) * t_step(k) + t_step(depth + 1)``: the tree grows depth - 1
  levels of k frontier tokens, then the draft catches up on the accepted path (depth + 1
  tokens). ``t_step(w)`` is one measured draft step over w tokens.
* ``E[tau]``: :func:`eagle3_jax.decoding.acceptance.expected_accept_length` from per-depth
  rates, each node's modelled acceptance times the head's live calibration
  ``accept_scale * accept_decay**level`` where the head has one
  (:mod:`eagle3_jax.decoding.calibration`: held-out rates overrate live decoding, the more
  the deeper the node; SmolLM2's shipped head: 0.62 x 0.86 per level).
* the rates: a head's measured per-depth top-r hit rates (training eval ``hits_per_step``, kept
  in a shipped head's ``acceptance.json``; TTT step i is exactly "depth i given correct
  ancestors"), so a rank-r sibling is credited with what was measured for rank r; else its
  top-1 accuracies (``acc_per_step``, siblings modelled geometrically), ``--accept-rates``, or
  the default profile ``a_d = 0.6 * 0.9**d``. Depths past the given list continue the last
  rates times 0.9 per level.

Costs are measured at the batch that will run (a padded batch of B rows verifies B trees in one
forward, and plain decoding's step also serves B rows), and cached per machine and model in
``$EAGLE3_JAX_HOME/autotune/<key>.json``, key a hash
of the platform, device kind, target config, JAX version and the source of the code being timed
(``COST_SOURCES``: a faster forward must not be judged by old numbers); draft steps are stored
under a hash of the draft config inside the same file. A flat cost curve (accelerators, memory
bound) picks a big tree, a steep one (CPUs, compute bound) a small one.

The decoder then times the model's ``RANKED_TREES`` best shapes, and its best trees of up to
half and up to twice the size (:func:`finalists`), as whole rounds against plain steps, all
interleaved in one measurement (:func:`measure_round_costs`: what the model leaves out, the
round's own work, included) and keeps the best measured speed-up at the modelled tau
(:func:`autotune_tree`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from eagle3_jax.decoding.acceptance import Rate, candidates
from eagle3_jax.decoding.costs import forward_curve, measure_draft_steps, measure_round
from eagle3_jax.decoding.eagle import PROBE_ROUNDS, RESUME_WINDOW, Fallback
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.kernels import library

TARGET_SIZES = (1, 2, 4, 8, 16, 32, 64)
DRAFT_WIDTHS = (1, 2, 4, 8, 16)
TOP_KS = (1, 2, 3, 4, 6, 8, 10)
DEPTHS = tuple(range(1, 9))


class AutotuneError(Eagle3Error, ValueError):
    """Bad acceptance rates or an empty search space; the message says what to pass."""


# ------------------------------------------------------------------------- cost model


def _interp(points: Mapping[int, float], x: float) -> float:
    xs = sorted(points)
    return float(np.interp(x, xs, [points[k] for k in xs]))


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds of one target forward over T tokens, and of one draft step over w tokens."""

    target: Mapping[int, float]
    draft: Mapping[int, float]

    def target_cost(self, total_tokens: int) -> float:
        return _interp(self.target, total_tokens)

    def draft_cost(self, depth: int, tree_top_k: int) -> float:
        return (depth - 1) * _interp(self.draft, tree_top_k) + _interp(self.draft, depth + 1)

    @property
    def max_tokens(self) -> int:
        return max(self.target)


# EAGLE is chosen only where the model predicts at least this speed-up. The model takes the
# head's acceptance from its held-out set (regenerated ShareGPT, whose greedy answers repeat
# more than the benchmark sets' and are easier to draft). Predicted -> measured
# (`bench speed --total-tokens auto`, shipped SmolLM2 heads, MT-bench): 1.17 -> 0.91x,
# 1.16 -> 0.80x, 1.30 -> 0.97x (900-step head, 1-token chain), and for the 2954-step head
# 1.88 -> 1.10x on MT-bench, 0.98x over the five sets, 0.79x on long-prompt summarisation
# (tree 4/4/8: the round's cost was modelled within 10%, its tau 3.07 against 2.0 measured).
# A head's live calibration (``accept_scale``, :mod:`eagle3_jax.decoding.calibration`) takes
# most of that optimism out; the rest varies by prompt (MT-bench's tau is not summarisation's).
# So the prediction only decides whether drafting is worth a try: the decoder then measures
# the acceptance on the user's own prompt and gives up where it does not pay
# (:func:`fallback_for`, :class:`eagle3_jax.decoding.eagle.Fallback`), which bounds a wrong
# try to its first probe rounds.
MIN_PREDICTED_SPEEDUP = 1.1


# The modelled best few tree shapes are then timed as whole rounds against plain steps
# (:func:`measure_round_costs`, cached like the costs) and the best measured speed-up is kept:
# the model leaves the round's own work out, and shapes it rates within a few percent of each
# other swapped places between re-measurements of the cost curve (4/4/8, 1/4/5, 2/3/8, 1/4/5
# on 2-core AMD EPYCs, 2026-12-04); :func:`finalists` adds the best tree of half the size,
# which the model's 8-node finalists crowded out on the AVX2-only EPYC on 2026-12-05 (it
# measured 0.12x faster), and the best of up to twice the size, which a noisy forward curve
# left out on the EPYC with AVX-512 on 2026-12-06. 1 turns it off.
RANKED_TREES = 3


@dataclasses.dataclass(frozen=True)
class TreeChoice:
    """A tree and what it is expected to do; ``measured``: the round's seconds (and plain
    decoding's) are a whole round's timing, not the cost model's sum."""

    tree: TreeConfig
    expected_accept_length: float
    seconds_per_round: float
    tokens_per_s: float
    plain_tokens_per_s: float
    measured: bool = False

    @property
    def predicted_speedup(self) -> float:
        return self.tokens_per_s / self.plain_tokens_per_s

    @property
    def pays_off(self) -> bool:
        """Whether the tree is predicted to beat plain decoding by the model's margin of error
        (``MIN_PREDICTED_SPEEDUP``)."""
        return self.predicted_speedup >= MIN_PREDICTED_SPEEDUP

    def describe(self) -> str:
        t = self.tree
        text = (f"tree_top_k={t.tree_top_k} depth={t.depth} total_tokens={t.total_tokens}: "
                f"modelled tau {self.expected_accept_length:.2f}, "
                f"{self.seconds_per_round * 1e3:.2f} ms per round"
                f"{' (measured)' if self.measured else ''}, {self.tokens_per_s:.1f} tokens/s "
                f"vs plain {self.plain_tokens_per_s:.1f} ({self.predicted_speedup:.2f}x)")
        if not self.pays_off:
            text += (f"; no tree is predicted to beat plain decoding here by the model's margin "
                     f"({MIN_PREDICTED_SPEEDUP}x): a verification forward costs too much more "
                     f"than a decode step on this device, or the head accepts too little "
                     f"(--mode vanilla is faster)")
        return text


def select_trees(costs: CostModel, rates: Sequence[Rate] | None = None, n: int = 1, *,
                 tree_top_k: int | None = None, depth: int | None = None,
                 tree_top_ks: Sequence[int] = TOP_KS, depths: Sequence[int] = DEPTHS,
                 accept_scale: float = 1.0, accept_decay: float = 1.0,
                 max_tokens: int | None = None, min_tokens: int = 2) -> list[TreeChoice]:
    """The ``n`` tree shapes (tree_top_k, depth) with the highest modelled tokens/s, each at its
    best total_tokens, best first (ties: the smaller tree).

    ``tree_top_k`` / ``depth`` fix that dimension (a user's ``--tree-top-k`` / ``--depth``);
    total_tokens ranges over ``min_tokens`` .. ``max_tokens`` (default: 2 .. the largest
    measured T).
    ``accept_scale``, ``accept_decay``: the head's live calibration
    (:mod:`eagle3_jax.decoding.calibration`): a node at draft level l (0: the root's children)
    counts ``accept_scale * accept_decay**l`` times its modelled acceptance, so with decay 1 the
    modelled tau is ``1 + accept_scale * (E[tau] - 1)``; 1 and 1 take the rates as they are.
    The nodes a tree holds are still the model's most probable (the draft ranks by its own
    scores, not by what verification will accept).
    """
    if not 0.0 <= accept_scale <= 1.5:
        raise AutotuneError(f"accept_scale must lie in [0, 1.5], got {accept_scale}; it is a "
                            "head's live tau - 1 over its modelled tau - 1")
    if not 0.0 < accept_decay <= 1.0:
        raise AutotuneError(f"accept_decay must lie in (0, 1], got {accept_decay}; it is the "
                            "live calibration's factor per draft level")
    tree_top_ks = (tree_top_k,) if tree_top_k is not None else tuple(tree_top_ks)
    depths = (depth,) if depth is not None else tuple(depths)
    max_tokens = costs.max_tokens if max_tokens is None else min(max_tokens, costs.max_tokens)
    plain = 1.0 / costs.target_cost(1)
    shapes: list[TreeChoice] = []
    for k in tree_top_ks:
        for d in depths:
            probs, levels = candidates(k, d, rates)
            scores = accept_scale * accept_decay ** levels * probs
            tau = 1.0 + np.concatenate([[0.0], np.cumsum(scores)])  # tau[n] for n drafts
            draft = costs.draft_cost(d, k)
            best: TreeChoice | None = None
            for total in range(max(min_tokens, 2), min(len(scores) + 1, max_tokens) + 1):
                seconds = costs.target_cost(total) + draft
                speed = tau[total - 1] / seconds
                if best is None or speed > best.tokens_per_s:
                    best = TreeChoice(TreeConfig(tree_top_k=k, depth=d, total_tokens=total),
                                      float(tau[total - 1]), seconds, speed, plain)
            if best is not None:
                shapes.append(best)
    if not shapes:
        raise AutotuneError(f"no tree fits tree_top_k={tree_top_ks}, depth={depths} and the "
                            f"sizes {max(min_tokens, 2)} to {max_tokens} tokens")
    return sorted(shapes, key=lambda c: -c.tokens_per_s)[:max(int(n), 1)]  # stable: ties keep order


def select_tree(costs: CostModel, rates: Sequence[Rate] | None = None, **kwargs) -> TreeChoice:
    """The valid tree with the highest modelled tokens/s (ties: the smaller tree); the keyword
    arguments are :func:`select_trees`'."""
    return select_trees(costs, rates, 1, **kwargs)[0]


# ------------------------------------------------------------------------- measuring, cache


def cache_root() -> Path:
    from eagle3_jax.checkpoints.default_model import cache_dir

    return cache_dir() / "autotune"


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# The code whose speed the cost model measures (paths under the package).
COST_SOURCES = ("model/target.py", "model/layers.py", "model/params.py", "draft/model.py",
                "decoding/tree.py", "decoding/costs.py", "decoding/eagle.py",
                "decoding/verify.py", "decoding/generate.py", "kernels/matmul.py",
                "kernels/attention.py", *library.SOURCES)


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A hash of ``COST_SOURCES``: changes whenever the timed code does."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in COST_SOURCES:
        h.update((root / rel).read_bytes())
    return h.hexdigest()[:16]


def machine_key(cfg) -> dict:
    """What the measurements depend on: platform, device kind, target config, JAX, our code and
    whether the CPU kernel is in use."""
    import jax

    from eagle3_jax.kernels import kernel_status

    device = jax.devices()[0]
    return {"platform": platform.platform(), "machine": platform.machine(),
            "backend": jax.default_backend(), "device_kind": device.device_kind,
            "target_config": dataclasses.asdict(cfg), "jax": jax.__version__,
            "code": code_digest(), "cpu_kernel": kernel_status()}


def cache_path(cfg, directory: str | Path | None = None) -> Path:
    return Path(directory or cache_root()) / f"{_digest(machine_key(cfg))}.json"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def measure_costs(target_params, cfg, head, context: int, *, batch: int = 1, repeats: int = 9,
                  sizes: Sequence[int] = TARGET_SIZES, widths: Sequence[int] = DRAFT_WIDTHS,
                  directory: str | Path | None = None,
                  log: Callable[[str], None] = lambda s: None) -> CostModel:
    """Measured (or cached) costs for ``context`` and ``batch`` rows on this machine (seconds
    of one call for the whole batch); writes the cache file."""
    path = cache_path(cfg, directory)
    data = _read(path)
    data.setdefault("key", machine_key(cfg))
    ctx = str(int(context)) if batch == 1 else f"{int(context)}x{int(batch)}"
    rows = "" if batch == 1 else f" for {batch} rows"
    target = data.setdefault("target", {}).setdefault(ctx, {})
    missing = [t for t in sizes if str(t) not in target]
    if missing:
        log(f"[autotune: timing target forwards of {missing} tokens at context {context}{rows}]")
        target.update({str(t): s for t, s in forward_curve(
            target_params, cfg, int(context), missing, repeats, batch=batch).items()})
    dkey = _digest(head.cfg.to_dict())
    draft = data.setdefault("draft", {}).setdefault(dkey, {}).setdefault(ctx, {})
    missing_w = [w for w in widths if str(w) not in draft]
    if missing_w:
        log(f"[autotune: timing draft steps of {missing_w} tokens{rows}]")
        draft.update({str(w): s for w, s in measure_draft_steps(
            head, target_params["embed"], int(context), missing_w, repeats, batch=batch).items()})
    if missing or missing_w:
        _write(path, data)
        log(f"[autotune: wrote {path}]")
    return CostModel(target={int(t): float(target[str(t)]) for t in sizes},
                     draft={int(w): float(draft[str(w)]) for w in widths})


def autotune_context(prompt_length: int) -> int:
    """The context the costs are measured at: the prompt length rounded up to 128 * 2**i."""
    from eagle3_jax.decoding.batching import bucket

    return bucket(max(int(prompt_length), 1), 128)


def finalists(costs: CostModel, rates: Sequence[Rate] | None, ranked: int,
              **kwargs) -> list[TreeChoice]:
    """The trees worth timing as whole rounds: the model's ``ranked`` best shapes, then (when
    ``ranked`` > 1) the model's best tree of at most half the best one's tokens and its best of
    more than the best one's tokens and at most twice them, where not among them already. The
    model's best few are often one size (8 nodes, within 2% of each other, on a 2-core AVX2-only
    AMD EPYC, 2026-12-05), a small tree's fixed costs are where the model errs most, and a slow
    spell in the forward curve it reads moves its pick a size: a curve of 5 interleaved repeats
    (now 9) on a 2-core AMD EPYC with AVX-512 (2026-12-06) had 8 tokens 3.7 ms dearer than 4
    where 8 measure 1-2 ms cheaper, and every finalist had 4 nodes.
    ``kwargs``: :func:`select_trees`'."""
    choices = select_trees(costs, rates, ranked, **kwargs)
    best = choices[0].tree.total_tokens
    if ranked > 1:
        for bounds in ({"max_tokens": best // 2},
                       {"min_tokens": best + 1, "max_tokens": 2 * best}):
            try:
                other = select_trees(costs, rates, 1, **bounds, **kwargs)[0]
            except AutotuneError:  # no tree of that size (too small, past the curve or the shape)
                continue
            if other.tree not in [c.tree for c in choices]:
                choices.append(other)
    return choices


def autotune_tree(target_params, cfg, head, prompt_length: int, *, batch: int = 1,
                  accept_rates: Sequence[Rate] | None = None, accept_scale: float = 1.0,
                  accept_decay: float = 1.0, tree_top_k: int | None = None,
                  depth: int | None = None, ranked: int = 1,
                  directory: str | Path | None = None,
                  log: Callable[[str], None] = lambda s: None) -> TreeChoice:
    """Measure (once per machine, model, context bucket and batch) and pick the tree for a
    padded batch of ``batch`` rows. ``accept_scale``, ``accept_decay``: :func:`select_trees`'.
    ``ranked`` > 1 (the decoder's ``RANKED_TREES``): where the model's best pays off, its
    :func:`finalists` are timed as whole rounds and the best measured speed-up (modelled tau x
    plain step / round) is kept."""
    context = autotune_context(prompt_length)
    costs = measure_costs(target_params, cfg, head, context, batch=batch, directory=directory,
                          log=log)
    choices = finalists(costs, accept_rates, ranked, tree_top_k=tree_top_k, depth=depth,
                        accept_scale=accept_scale, accept_decay=accept_decay)
    if len(choices) == 1 or not choices[0].pays_off:
        return choices[0]
    costs = measure_round_costs(target_params, cfg, head, [c.tree for c in choices], context,
                                batch=batch, directory=directory, log=log)
    measured = [dataclasses.replace(
        choice, seconds_per_round=cost["round"], plain_tokens_per_s=1.0 / cost["step"],
        tokens_per_s=choice.expected_accept_length / cost["round"], measured=True)
        for choice, cost in zip(choices, costs)]
    best = max(measured, key=lambda c: c.predicted_speedup)  # ties: the model's order
    log("[autotune: whole rounds of the finalist trees, speed-up at the modelled tau: "
        + ", ".join(f"{c.tree.tree_top_k}/{c.tree.depth}/{c.tree.total_tokens} "
                    f"{c.predicted_speedup:.2f}x" for c in measured) + "]")
    return best


def measure_round_costs(target_params, cfg, head, trees: Sequence[TreeConfig], context: int,
                        *, batch: int = 1, repeats: int = 9,
                        directory: str | Path | None = None,
                        log: Callable[[str], None] = lambda s: None) -> list[dict[str, float]]:
    """Measured (or cached) seconds of one whole round of each of ``trees`` and of one plain
    decode step (:func:`eagle3_jax.decoding.costs.measure_round`) at ``context`` and ``batch``.
    The trees not cached yet are timed together, interleaved with one plain step, so the trees
    the chooser compares saw the same machine."""
    path = cache_path(cfg, directory)
    data = _read(path)
    data.setdefault("key", machine_key(cfg))
    rounds = data.setdefault("round", {})

    def where(tree):
        return (f"{_digest(head.cfg.to_dict())}/{tree.tree_top_k}-{tree.depth}-"
                f"{tree.total_tokens}/{int(context)}x{int(batch)}")

    missing = [tree for tree in dict.fromkeys(trees) if where(tree) not in rounds]
    if missing:
        log(f"[autotune: timing whole rounds of tree"
            f"{'s' if len(missing) > 1 else ''} "
            + ", ".join(f"{t.tree_top_k}/{t.depth}/{t.total_tokens}" for t in missing)
            + f" against plain steps at context {context}, interleaved]")
        for tree, cost in zip(missing, measure_round(target_params, cfg, head, missing,
                                                     int(context), repeats, batch=batch)):
            rounds[where(tree)] = cost
        _write(path, data)
    return [{"round": float(rounds[where(t)]["round"]), "step": float(rounds[where(t)]["step"])}
            for t in trees]


def fallback_for(target_params, cfg, head, tree: TreeConfig, *,
                 probe_rounds: int = PROBE_ROUNDS, resume_window: int = RESUME_WINDOW,
                 directory: str | Path | None = None,
                 log: Callable[[str], None] = lambda s: None) -> Callable[[int, int], Fallback]:
    """``fallback(prompt_width, batch) -> Fallback``: the break-even acceptance of ``tree`` at
    that context and padded batch: a whole round's measured seconds over a plain step's
    (:func:`measure_round_costs`, once per machine, model, tree, context bucket and batch: the
    verification forward reads a longer cache for longer prompts, and B rows verify B trees in
    one forward; the tree chooser's model leaves out the round's own work, about a tenth of it
    on this CPU, which is exactly the margin that decides a prompt near break-even)."""

    @functools.lru_cache(maxsize=None)
    def at(context: int, batch: int) -> Fallback:
        cost, = measure_round_costs(target_params, cfg, head, [tree], context, batch=batch,
                                    directory=directory, log=log)
        fallback = Fallback(cost["round"] / cost["step"], probe_rounds, resume_window)
        rows = "" if batch == 1 else f" and {batch} rows"
        log(f"[fallback: at a {context}-token context{rows} a round takes "
            f"{cost['round'] * 1e3:.1f} ms and a plain step {cost['step'] * 1e3:.1f} ms, so a "
            f"round must emit {fallback.break_even:.2f} tokens to pay; checked from round "
            f"{probe_rounds}"
            + (f"; after giving up, the draft's hits checked every {resume_window} plain steps]"
               if resume_window else "]"))
        return fallback

    return lambda prompt_width, batch=1: at(autotune_context(prompt_width), int(batch))
