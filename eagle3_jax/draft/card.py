"""A head's model card (``README.md`` beside its weights), written from the records of its run.

Nothing in a card is typed by hand: the training run gives the configuration, the tokens and
wall time (``metrics.jsonl`` train rows), and the held-out per-depth accuracy and top-r hit
rates (its latest eval); an optional build record (JSON written by the command that built the
head: data counts, hardware, stage times, the command itself) and ``bench speed`` reports add
the data and the measured results.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any, Sequence

from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.load import METRICS_FILE, latest_eval, rates_of, read_metrics


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _results_section(report: dict, name: str) -> str:
    cfg = report.get("config", {})
    tree = cfg.get("tree", {})
    rows = []
    for task, r in report.get("tasks", {}).items():
        by_depth = " / ".join(f"{a:.2f}" for a in r.get("accept_by_depth", [])[:4])
        rows.append((task, r["tau"], by_depth, f"{r['speedup']:.2f}x",
                     {True: "yes", False: "NO", None: "-"}[r.get("identical")]))
    mean = report.get("mean", {})
    rows.append(("mean", mean.get("tau", 0.0), "", f"{mean.get('speedup', 0.0):.2f}x", ""))
    title = (f"`{name}`: temperature {cfg.get('temperature', 0)}, tree "
             f"{tree.get('tree_top_k')}/{tree.get('depth')}/{tree.get('total_tokens')} "
             f"(tree_top_k/depth/total_tokens{', auto' if cfg.get('total_tokens_auto') else ''})"
             f", {cfg.get('num_prompts')} prompts per task, {cfg.get('max_new_tokens')} new "
             f"tokens, batch 1")
    return title + "\n\n" + _table(["task", "tau", "accepted >= d drafts (d = 1..4)",
                                    "speed-up vs plain (this CPU)", "identical to plain"], rows)


def model_card(run_dir: str | Path, step: int, cfg: DraftConfig, *, title: str,
               weights_dtype: str, build: dict | None = None,
               results: Sequence[tuple[str, dict]] = (), live: dict | None = None) -> str:
    """The card's markdown for the step-``step`` head of the run at ``run_dir``; ``live``: the
    head's ``bench calibrate`` record (``acceptance.json``'s ``"live"``), if it has one."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir / METRICS_FILE)
    train = [r for r in metrics if r.get("kind") == "train" and r.get("step", 0) <= step]
    last = train[-1] if train else {}
    ev = latest_eval(run_dir / METRICS_FILE, step) or {}
    build = build or {}
    out = [f"# {title}", ""]
    out += ["EAGLE-3 draft head (one decoder layer over the target's layers "
            f"{', '.join(map(str, cfg.tap_layers))}), in the released EAGLE-3 layout "
            f"(`config.json` + `model.safetensors`, weights stored as {weights_dtype}, loaded "
            "in the target's dtype). `acceptance.json` holds the held-out per-depth top-r hit "
            "rates the tree chooser (`--total-tokens auto`) models trees from.", ""]
    out += ["## Head", "", _table(["hidden", "heads / kv heads", "mlp", "draft vocabulary",
                                   "TTT steps", "RoPE theta"],
                                  [(cfg.hidden_size, f"{cfg.num_heads} / {cfg.num_kv_heads}",
                                    cfg.intermediate_size, cfg.draft_vocab_size, cfg.ttt_steps,
                                    cfg.rope_theta)]), ""]
    if build.get("data"):
        out += ["## Data", ""]
        out += [f"- {line}" for line in build["data"]] + [""]
    out += ["## Training", ""]
    out += [f"- steps: {step}; tokens trained on: {last.get('tokens', 'n/a')}; wall time: "
            f"{last.get('seconds', 'n/a')} s of training",
            f"- hardware: {build.get('hardware') or platform.processor() or platform.machine()}"]
    out += [f"- {line}" for line in build.get("training", [])] + [""]
    if ev:
        hits = ev.get("hits_per_step") or [[a] for a in ev["acc_per_step"]]
        ranks = [r for r in (1, 2, 4, 10) if r <= len(hits[0])]
        rows = [(d + 1, *[h[r - 1] for r in ranks]) for d, h in enumerate(hits)]
        out += [f"## Held-out accuracy by depth (eval at step {ev['step']})", "",
                "Share of held-out assistant tokens whose target token is among the draft's "
                "top r at each depth, its ancestors correct (training-time test, teacher "
                f"forced). Simulated chain acceptance length: {ev['accept_length']:.2f}.", "",
                _table(["depth", *[f"top-{r}" for r in ranks]], rows), ""]
    if live:
        from eagle3_jax.decoding.calibration import live_level_scale

        scale, decay = live_level_scale(live, rates_of(ev) if ev else None)
        prompts = live.get("prompts", {})
        rows = [(f"{t['tree_top_k']}/{t['depth']}/{t['total_tokens']}", t["modelled_tau"],
                 t["live_tau"], t["rounds"]) for t in live["trees"]]
        out += ["## Live acceptance on held-out prompts (`python -m eagle3_jax.bench calibrate`)",
                "", f"Greedy decoding of {prompts.get('count')} {prompts.get('source')} of "
                f"{prompts.get('min_chars')}-{prompts.get('max_chars')} characters (none of the "
                f"evaluation sets), {live.get('max_new_tokens')} new tokens each, against the tau "
                f"the tree chooser models from the rates above (pooled live over modelled extra "
                f"tokens: **{live['scale']:.3f}**). The chooser credits a node at draft level l "
                f"with {scale:.3f} x {decay:.2f}^l of its modelled acceptance "
                "(`decoding/calibration.py`: the per-level fit of these trees).", "",
                _table(["tree (top_k/depth/total)", "modelled tau", "live tau", "rounds"],
                       rows), ""]
    if results:
        out += ["## Results (`python -m eagle3_jax.bench speed`)", ""]
        for name, report in results:
            out += [_results_section(report, name), ""]
    if build.get("notes"):
        out += ["## Notes", ""] + [f"- {line}" for line in build["notes"]] + [""]
    if build.get("command"):
        out += ["## Rebuild", "", "```bash", build["command"], "```", ""]
    return "\n".join(out)


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
