"""``python -m eagle3_jax.bench speed``: EAGLE-3 acceptance length and speed-up on the paper tasks.

For each task (MT-bench, HumanEval, GSM8K, Alpaca, CNN/DailyMail as ``sum``; the question files
in ``eagle3_jax/bench/prompts``) the first ``--num-prompts`` prompts are decoded greedily at
batch 1 with plain decoding and with EAGLE, the two interleaved per prompt (same
implementation, same machine, compilation excluded). MT-bench has two turns: turn 2 is asked
with turn 1 and its answer in context; it re-runs that history in its prefill, as the EAGLE
papers measure, or with ``--reuse-prefix`` starts from each decoder's own caches of turn 1
(a chat server's prefix cache; ``prompt_tokens`` and ``reused_prompt_tokens_eagle`` count
what the prefills skipped). Reported per task (reference §5, §7):

  * ``tau``: acceptance length, tokens per verification round (accepted drafts + 1);
  * ``accept_by_depth``: fraction of rounds accepting at least d draft tokens, d = 1..depth;
  * ``tokens_per_s_vanilla`` / ``tokens_per_s_eagle``: medians over prompts (and turns) of
    new tokens / seconds; ``speedup``: their ratio;
  * with ``--hf``: ``tokens_per_s_hf``, HF transformers float32 greedy ``generate`` on the same
    prompt (interleaved), and ``speedup_vs_hf``;
  * ``identical``: every EAGLE answer equals the plain one token for token (it must, greedy;
    None with ``--temperature`` > 0, where both sample);
  * with the fallback: EAGLE gives up drafting where the prompt's measured acceptance does
    not pay for a round here (:class:`eagle3_jax.decoding.eagle.Fallback`) and decodes plainly
    until the draft's hits say drafting would pay again; ``fell_back`` counts the turns that
    gave up at least once, ``resumed`` those that then drafted again. ``tau`` and
    ``accept_by_depth`` stay over the rounds that drafted.

By default it measures what the decode CLI does by default: the tree chosen for this machine
(``--total-tokens auto``, :mod:`eagle3_jax.decoding.autotune`) with the fallback. Where the
chooser predicts no tree to beat plain decoding here (the decoder would then decode plainly)
it says so and measures the chosen tree anyway (``config.decoder_would_draft``). A tree flag
(``--depth``, ``--tree-top-k``, ``--total-tokens N``) fixes the tree, without the fallback, as
the decoder does; ``--fallback`` / ``--no-fallback`` force it on or off.

``--draft`` defaults to the target's shipped head (``eagle3_jax.draft.shipped``). With
``--ceiling`` the target drafts for itself (:mod:`eagle3_jax.decoding.ceiling`): ``tau`` is
then the most any head can accept with that tree at that temperature (its times mean nothing).

Writes ``--out`` (JSON ``{"tasks": {name: {...}}, "mean": {...}, "config": {...}}``), the
markdown table next to it (``.md``, also printed) and a plot (``.png``: tau and speed-up per
task). Each conversation's turn records are appended to ``OUT.turns.jsonl`` as it finishes;
``--resume`` goes on from there (a long run cut short loses one conversation); a run without
it keeps the file it replaces as ``OUT.turns.jsonl.old``. A random head
accepts nothing and is slower than plain decoding; only a trained head makes the numbers
meaningful.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from eagle3_jax.errors import UsageError

TASKS = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum")
PROMPTS_DIR = Path(__file__).parent / "prompts"


def load_questions(task: str, num_prompts: int) -> list[list[str]]:
    """The user turns of the first ``num_prompts`` questions of ``task``."""
    path = PROMPTS_DIR / task / "question.jsonl"
    if task not in TASKS or not path.is_file():
        raise UsageError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append([str(t) for t in json.loads(line)["turns"]])
            if len(out) == num_prompts:
                break
    return out


def _timed(decoder, ids: list[int], warm: set, name: str, repeats: int, prefix=None,
           keep: bool = False):
    """(Generation, median seconds) of ``repeats`` batch-1 runs; a new shape warms up first.
    ``prefix``: the previous turn's caches (a :class:`CachedPrefix`) to start from; ``keep``:
    the generation keeps its own."""
    import jax

    from eagle3_jax.decoding import bucket

    shape = (name, bucket(len(ids)), keep,
             None if prefix is None else tuple(a.shape for a in jax.tree.leaves(prefix.caches)))
    call = functools.partial(decoder.generate_batch, [ids], [prefix], keep=keep)
    if shape not in warm:
        call()  # compiles (untimed) and runs once
        warm.add(shape)
    gens = [call()[0] for _ in range(repeats)]
    return gens[0], statistics.median(g.seconds for g in gens)


def _hf_generate(model, ids: list[int], max_new_tokens: int, eos: tuple[int, ...],
                 pad_id: int) -> tuple[int, float]:
    """(new tokens, seconds) of HF transformers greedy ``generate`` on one prompt."""
    import torch

    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=list(eos), pad_token_id=pad_id)
    seconds = time.perf_counter() - start
    new = out[0, len(ids):].tolist()
    return len([t for t in new if t not in eos]), seconds


def run_task(conversations: list[list[str]], target, decoders: dict, depth: int,
             repeats: int = 1, warm: set | None = None,
             log: Callable[[str], None] = lambda s: None, hf_model=None,
             max_new_tokens: int = 0, reuse_prefix: bool = False,
             done: dict[int, list[dict]] | None = None,
             on_conversation: Callable[[int, list[dict]], None] = lambda i, turns: None,
             ) -> dict[str, Any]:
    """Decode every turn with both decoders (and HF transformers when ``hf_model`` is given),
    interleaved; the task's row of the report. ``reuse_prefix``: each decoder starts a turn
    from its own caches of the turn before (the prefill runs only the new tokens).
    ``done``: conversations (by index) whose turns' records an earlier run measured, not
    decoded again; ``on_conversation(index, records)`` after each (:class:`TurnLog`)."""
    warm = set() if warm is None else warm
    done = done or {}
    per_turn: list[dict[str, Any]] = []  # one record per decoded turn, in order
    for index, conversation in enumerate(conversations):
        turns = done.get(index)
        if turns is None:
            turns = _decode_conversation(conversation, target, decoders, repeats, warm, log,
                                         hf_model, max_new_tokens, reuse_prefix)
            on_conversation(index, turns)
        per_turn.extend(turns)
    return summarise(per_turn, depth, len(conversations))


def _decode_conversation(conversation: list[str], target, decoders: dict, repeats: int,
                         warm: set, log: Callable[[str], None], hf_model, max_new_tokens: int,
                         reuse_prefix: bool) -> list[dict[str, Any]]:
    """One record per turn of ``conversation`` (its user turns; each later turn is asked with
    the plain decoder's answers before it in context)."""
    from eagle3_jax.decoding.acceptance import mean_accept_length

    tok = target.tokenizer
    sampled = decoders["vanilla"].sampling.temperature != 0
    history: list[dict[str, str]] = []
    before = {"vanilla": None, "eagle": None}  # each decoder's caches of the turn before
    records = []
    for turn, user in enumerate(conversation, 1):
        history.append({"role": "user", "content": user})
        ids = tok.apply_chat_template(history, add_generation_prompt=True)
        plain, t_plain = _timed(decoders["vanilla"], ids, warm, "vanilla", repeats,
                                before["vanilla"], reuse_prefix)
        spec, t_spec = _timed(decoders["eagle"], ids, warm, "eagle", repeats,
                              before["eagle"], reuse_prefix)
        record = {"turn": turn, "prompt_tokens": len(ids),
                  "new_tokens_vanilla": len(plain.token_ids),
                  "new_tokens": len(spec.token_ids), "rounds": spec.rounds,
                  "plain_steps": spec.plain_steps, "resumes": spec.resumes,
                  "tau": mean_accept_length(spec.accept_hist) if spec.rounds else None,
                  "accept_hist": list(spec.accept_hist),
                  # Greedy EAGLE must equal plain decoding; sampled answers differ by design.
                  "identical": None if sampled else plain.token_ids == spec.token_ids,
                  "seconds_vanilla": t_plain, "seconds_eagle": t_spec}
        if reuse_prefix:
            before = {"vanilla": plain.prefix, "eagle": spec.prefix}
            record["reused_prompt_tokens_eagle"] = spec.reused
        if hf_model is not None:
            n, seconds = _hf_generate(hf_model, ids, max_new_tokens, tok.eos_token_ids,
                                      tok.pad_token_id)
            record.update(new_tokens_hf=n, seconds_hf=seconds)
        records.append(record)
        history.append({"role": "assistant",
                        "content": tok.decode(plain.token_ids, skip_special_tokens=True)})
        tau = "-" if record["tau"] is None else f"{record['tau']:.2f}"
        log(f"  {len(ids)} prompt tokens{f' ({spec.reused} reused)' if reuse_prefix else ''}"
            f": vanilla {_speed(record, 'vanilla'):.1f} tok/s, eagle "
            f"{_speed(record, 'eagle'):.1f} tok/s, {spec.rounds} rounds, tau {tau}"
            + (f", {spec.plain_steps} plain steps, resumed {spec.resumes}x"
               if spec.plain_steps else ""))
    return records


def summarise(per_turn: list[dict[str, Any]], depth: int, prompts: int) -> dict[str, Any]:
    """A task's row of the report from its turns' records."""
    from eagle3_jax.decoding.acceptance import mean_accept_length

    hist = [sum(column) for column in zip(*(r["accept_hist"] for r in per_turn))]
    total = max(sum(hist), 1)
    vanilla = statistics.median(_speed(r, "vanilla") for r in per_turn)
    eagle = statistics.median(_speed(r, "eagle") for r in per_turn)
    hf = {}
    if "seconds_hf" in per_turn[0]:
        hf_speed = statistics.median(_speed(r, "hf") for r in per_turn)
        hf = {"tokens_per_s_hf": hf_speed, "speedup_vs_hf": eagle / hf_speed}
    by_turn = {}  # turn k of every conversation: median EAGLE over median plain tok/s
    for k in sorted({r["turn"] for r in per_turn}):
        rows = [r for r in per_turn if r["turn"] == k]
        by_turn[str(k)] = (statistics.median(_speed(r, "eagle") for r in rows)
                           / max(statistics.median(_speed(r, "vanilla") for r in rows), 1e-9))
    taus = [r["tau"] for r in per_turn if r["tau"] is not None]
    identical = [r["identical"] for r in per_turn]
    reused = "reused_prompt_tokens_eagle" in per_turn[0]
    return {
        **hf,
        "tau": mean_accept_length(hist),
        "tau_median_turn": statistics.median(taus) if taus else None,
        # hist[j]: rounds that emitted j tokens = accepted j - 1 drafts.
        "accept_by_depth": [sum(hist[d + 1:]) / total for d in range(1, depth + 1)],
        "tokens_per_s_vanilla": vanilla, "tokens_per_s_eagle": eagle,
        "speedup": eagle / max(vanilla, 1e-9), "speedup_by_turn": by_turn,
        "identical": None if None in identical else all(identical),
        "prompts": prompts, "turns": len(per_turn),
        "new_tokens": sum(r["new_tokens"] for r in per_turn),
        "rounds": sum(r["rounds"] for r in per_turn), "accept_hist": hist,
        "fell_back": sum(r["plain_steps"] > 0 for r in per_turn),
        "resumed": sum(r.get("resumes", 0) > 0 for r in per_turn),
        **({"prompt_tokens": sum(r["prompt_tokens"] for r in per_turn),
            "reused_prompt_tokens_eagle": sum(r["reused_prompt_tokens_eagle"] for r in per_turn)}
           if reused else {}),
        "per_turn": per_turn,
    }


class TurnLog:
    """Each conversation's turn records, appended to ``path`` (``OUT.turns.jsonl``; its first
    line the settings) as the conversation finishes, so a run cut short loses at most the
    conversation it was in: ``--resume`` reads back what was measured with the same settings
    and decodes only the rest (also to extend a run to more ``--num-prompts``). Without it,
    an earlier file is kept as ``OUT.turns.jsonl.old``."""

    def __init__(self, path: Path, settings: dict, resume: bool,
                 log: Callable[[str], None] = lambda s: None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        settings = json.loads(json.dumps(settings))  # as it reads back (tuples as lists)
        self.done: dict[tuple[str, int], list[dict]] = {}
        if not resume and path.is_file():  # one earlier run's records survive a repeat
            path.replace(path.with_name(path.name + ".old"))
        if resume and path.is_file():
            lines = path.read_text(encoding="utf-8").splitlines()
            before = json.loads(lines[0])["settings"] if lines else {}
            if before != settings:
                differ = sorted(k for k in set(before) | set(settings)
                                if before.get(k) != settings.get(k))
                raise UsageError(f"--resume: {path} was measured with other settings "
                                 f"({', '.join(differ)}); match them or drop --resume to "
                                 f"start again")
            for line in lines[1:]:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # the line a kill cut short
                    break
                self.done[(entry["task"], entry["index"])] = entry["turns"]
            log(f"[resume: {len(self.done)} conversations measured before, from {path}]")
        entries = [{"settings": settings}] + [{"task": t, "index": i, "turns": turns}
                                              for (t, i), turns in self.done.items()]
        partial = path.with_name(path.name + ".tmp")
        partial.write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8")
        partial.replace(path)

    def measured(self, task: str) -> dict[int, list[dict]]:
        return {i: turns for (t, i), turns in self.done.items() if t == task}

    def record(self, task: str, index: int, turns: list[dict]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"task": task, "index": index, "turns": turns}) + "\n")


def _speed(record: dict[str, Any], decoder: str) -> float:
    """A turn's tokens per second for ``decoder`` ("vanilla", "eagle" or "hf")."""
    tokens = record["new_tokens" if decoder == "eagle" else f"new_tokens_{decoder}"]
    seconds = record[f"seconds_{decoder}"]
    return tokens / max(seconds, 1e-9)


def report_table(tasks: dict[str, dict], mean: dict) -> str:
    from eagle3_jax.bench.common import markdown_table

    with_hf = all("tokens_per_s_hf" in r for r in tasks.values())
    with_fallback = any(r.get("fell_back") for r in tasks.values())
    rows = []
    for name, r in tasks.items():
        hf = (r["tokens_per_s_hf"], f"{r['speedup_vs_hf']:.2f}x") if with_hf else ()
        fell = ((f"{r['fell_back']}/{r['turns']}", f"{r.get('resumed', 0)}/{r['fell_back']}")
                if with_fallback else ())
        rows.append((name, r["tau"], " / ".join(f"{a:.2f}" for a in r["accept_by_depth"]),
                     r["tokens_per_s_vanilla"], r["tokens_per_s_eagle"], f"{r['speedup']:.2f}x",
                     *hf, *fell, {True: "yes", False: "NO", None: "(sampled)"}[r["identical"]]))
    hf_mean = ("", f"{mean['speedup_vs_hf']:.2f}x") if with_hf else ()
    rows.append(("mean", mean["tau"], "", "", "", f"{mean['speedup']:.2f}x", *hf_mean,
                 *(("", "") if with_fallback else ()), ""))
    hf_cols = ["HF float32 tok/s", "eagle vs HF"] if with_hf else []
    fell_cols = ["gave up drafting (turns)", "resumed (of those)"] if with_fallback else []
    return markdown_table(["task", "tau", "accepted >= d drafts (d = 1..)", "vanilla tok/s",
                           "eagle tok/s", "speed-up", *hf_cols, *fell_cols, "identical"], rows)


def plot(path: Path, tasks: dict[str, dict], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(tasks)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.bar(names, [tasks[n]["tau"] for n in names], color="tab:blue")
    left.set_ylabel("acceptance length tau")
    left.set_ylim(bottom=0)
    right.bar(names, [tasks[n]["speedup"] for n in names], color="tab:green")
    right.axhline(1.0, color="gray", ls="--")
    right.set_ylabel("speed-up over plain decoding")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle3_jax.bench speed",
                                description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of {', '.join(TASKS)}")
    p.add_argument("--num-prompts", type=int, default=10, help="prompts per task (max 80)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--draft", default=None, metavar="PATH",
                   help="EAGLE-3 head: released-format folder or training run / checkpoint "
                        "(default: the target's shipped head)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (outputs checked identical); > 0 samples both decoders "
                        "(tau measured; texts differ by design)")
    p.add_argument("--target", default=None, help="preset, HF folder or .gguf (default SmolLM2)")
    p.add_argument("--depth", type=int, default=None,
                   help="draft tree levels incl. the root, fixing the tree (default: the auto "
                        "tree)")
    p.add_argument("--tree-top-k", type=int, default=None,
                   help="tree children per node, fixing the tree (not a sampling cut-off)")
    p.add_argument("--total-tokens", default=None,
                   help="a number (a fixed tree) or 'auto' (the default without tree flags: "
                        "the tree chosen for this machine, as the decode CLI does)")
    p.add_argument("--accept-rates", default=None, metavar="A1,A2,...",
                   help="per-depth acceptance rates the auto tree is modelled from (default: "
                        "the head's record, else 0.6*0.9^d)")
    p.add_argument("--fallback", action=argparse.BooleanOptionalAction, default=None,
                   help="give up drafting where the measured acceptance does not pay (default: "
                        "on with the auto tree, off with a fixed one, as the decode CLI does)")
    p.add_argument("--resume-window", type=int, default=None, metavar="N",
                   help="with the fallback: plain steps between the draft's catch-ups, where "
                        "drafting resumes if the draft's hits say it pays (default: the "
                        "decode CLI's, eagle.RESUME_WINDOW; 0: a give-up is for good)")
    p.add_argument("--reuse-prefix", action="store_true",
                   help="start each turn from the turn before's KV caches, as a chat server "
                        "with a prefix cache does (both decoders; the prefill runs only the "
                        "new tokens). Off: every turn re-runs its whole history, as the EAGLE "
                        "papers measure")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and mode")
    p.add_argument("--hf", action="store_true",
                   help="also time HF transformers float32 greedy generate on the same prompts "
                        "(interleaved; needs torch)")
    p.add_argument("--ceiling", action="store_true",
                   help="the target drafts for itself (a draft with q = p, "
                        "eagle3_jax.decoding.ceiling): tau is the most any head can accept "
                        "with this tree and temperature; its times are not a speed-up")
    p.add_argument("--resume", action="store_true",
                   help="go on from OUT.turns.jsonl (every conversation's records, written as "
                        "it finishes): what it holds for the same settings is not decoded "
                        "again; also extends a run to more --num-prompts")
    p.add_argument("--out", default="bench_speed.json")
    p.add_argument("--no-plot", action="store_true")
    return p


def main(argv: Sequence[str] | None = None, *, load_fn: Callable | None = None) -> int:
    from eagle3_jax.bench.common import run_bench_cli

    return run_bench_cli(build_parser(), run, argv, load_fn)


def run(args: argparse.Namespace, load_fn: Callable | None) -> dict:
    from eagle3_jax.bench.common import draft_or_shipped, machine_description, write_json
    from eagle3_jax.cli.decode import (autotune, parse_accept_rates, parse_total_tokens,
                                       resolve_tree)
    from eagle3_jax.cli.output import log
    from eagle3_jax.decoding.decoders import CompileCache, EagleDecoder, PlainDecoder
    from eagle3_jax.decoding.eagle import draft_proposer
    from eagle3_jax.decoding.sampling import sampling_from_flags
    from eagle3_jax.draft.load import check_head_path, load_head

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks or any(t not in TASKS for t in tasks):
        raise UsageError(f"--tasks must name some of {', '.join(TASKS)}, got {args.tasks!r}")
    if not 1 <= args.num_prompts <= 80 or args.max_new_tokens < 1 or args.repeats < 1:
        raise UsageError("--num-prompts must be in 1..80, --max-new-tokens and --repeats >= 1")
    if args.ceiling and (args.fallback or args.hf):
        raise UsageError("--ceiling measures acceptance only; drop --fallback and --hf")
    total_tokens = parse_total_tokens(args.total_tokens)
    if total_tokens is None and args.tree_top_k is None and args.depth is None:
        total_tokens = "auto"  # the decode CLI's default tree
    if args.fallback is None:  # the decode CLI's: the fallback comes with the auto tree
        args.fallback = total_tokens == "auto" and not args.ceiling
    if args.resume_window is not None and not args.fallback:
        raise UsageError("--resume-window applies with the fallback (the default with the auto "
                         "tree, or --fallback); add --fallback or drop this flag")
    if args.resume_window is not None and (args.resume_window < 0 or args.resume_window == 1):
        raise UsageError(f"--resume-window must be 0 (never resume) or >= 2, got "
                         f"{args.resume_window}")
    rates = parse_accept_rates(args.accept_rates)
    tree = (None if total_tokens == "auto"
            else resolve_tree(total_tokens, args.tree_top_k, args.depth))
    args.draft = draft_or_shipped(args.draft, args.target)
    check_head_path(args.draft)
    sampling = sampling_from_flags(args.temperature, 1.0, 0)
    questions = {t: load_questions(t, args.num_prompts) for t in tasks}

    if load_fn is None:
        from eagle3_jax.checkpoints import load_target as load_fn
    target = load_fn(args.target)
    loaded = load_head(args.draft, target.cfg).serving()
    head, description = loaded.head, loaded.description
    would_draft = None  # whether the decoder would draft with the auto tree here
    if tree is None:
        first = target.tokenizer.apply_chat_template(
            [{"role": "user", "content": questions[tasks[0]][0][0]}], add_generation_prompt=True)
        choice = autotune(target, loaded, len(first), args.tree_top_k, args.depth, rates)
        tree, would_draft = choice.tree, choice.pays_off
        if not would_draft:
            log("[no tree is predicted to beat plain decoding here, so the decode CLI would "
                "decode plainly; measuring the chosen tree anyway]")
    hf_model = None
    if args.hf:
        if args.temperature != 0:
            raise UsageError("--hf times greedy decoding; drop --temperature")
        from eagle3_jax.bench.forward import load_hf_reference

        hf_model = load_hf_reference(Path(str(target.weights)))
    fallback = window = None
    if args.fallback:
        from eagle3_jax.decoding.autotune import fallback_for
        from eagle3_jax.decoding.eagle import RESUME_WINDOW

        window = RESUME_WINDOW if args.resume_window is None else args.resume_window
        fallback = fallback_for(target.params, target.cfg, head, tree, resume_window=window,
                                log=log)
    cache = CompileCache(log)
    proposer = draft_proposer
    if args.ceiling:
        from eagle3_jax.decoding.ceiling import TargetProposer

        proposer = TargetProposer(sampling)
        description = f"the target drafting for itself (the ceiling; head {description})"
    decoders = {"vanilla": PlainDecoder(target, sampling, args.max_new_tokens, 0,
                                        compile_cache=cache),
                "eagle": EagleDecoder(target, sampling, args.max_new_tokens, 0, head=head,
                                      tree=tree, compile_cache=cache, fallback=fallback,
                                      proposer=proposer)}
    out = Path(args.out)
    settings = {"target": str(target.source), "draft": description,
                "tree": {"tree_top_k": tree.tree_top_k, "depth": tree.depth,
                         "total_tokens": tree.total_tokens},
                "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                "fallback": args.fallback, "resume_window": window,
                "reuse_prefix": args.reuse_prefix, "repeats": args.repeats, "hf": args.hf,
                "ceiling": args.ceiling}
    turn_log = TurnLog(out.with_suffix(".turns.jsonl"), settings, args.resume, log)
    log(f"[speed: {target.source} with {description}; tree tree_top_k={tree.tree_top_k} depth="
        f"{tree.depth} total_tokens={tree.total_tokens}]")
    results, warm = {}, set()
    start = time.perf_counter()
    for task in tasks:
        done = turn_log.measured(task)
        log(f"[{task}: {len(questions[task])} prompts"
            + (f", {sum(i < args.num_prompts for i in done)} measured before]" if done else "]"))
        results[task] = run_task(questions[task], target, decoders, tree.depth, args.repeats,
                                 warm, log, hf_model, args.max_new_tokens, args.reuse_prefix,
                                 done, functools.partial(turn_log.record, task))
    mean = {"tau": statistics.mean(r["tau"] for r in results.values()),
            "speedup": statistics.mean(r["speedup"] for r in results.values())}
    if hf_model is not None:
        mean["speedup_vs_hf"] = statistics.mean(r["speedup_vs_hf"] for r in results.values())
    config = {**settings, "total_tokens_auto": total_tokens == "auto",
              "decoder_would_draft": would_draft,
              "num_prompts": args.num_prompts, "batch_size": 1,
              "seconds": round(time.perf_counter() - start, 1),  # this run's, not the resumed
              "conversations_resumed": len(turn_log.done), "machine": machine_description()}
    report = {"tasks": results, "mean": mean, "config": config}
    write_json(out, report)
    table = report_table(results, mean)
    print(table)
    out.with_suffix(".md").write_text(table + "\n")
    written = [out, out.with_suffix(".md")]
    if not args.no_plot:
        plot(out.with_suffix(".png"), results,
             f"EAGLE-3 on {Path(str(getattr(target, 'weights', None) or target.source)).name}"
             f", tree {tree.tree_top_k}/{tree.depth}/{tree.total_tokens}, {args.num_prompts} "
             f"prompts/task, batch 1, T={args.temperature:g}")
        written.append(out.with_suffix(".png"))
    log(f"[wrote {', '.join(map(str, written))}]")
    return report
