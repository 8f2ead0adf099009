"""Command-line decoder: ``python -m eagle3_jax.decode`` (also ``eagle3-decode``).

With no arguments it loads the default target (SmolLM2-135M-Instruct) and streams the answer to
a built-in example question. ``--prompt`` asks one question; ``--prompts-file`` reads JSONL, one
``{"prompt": str}`` or ``{"turns": [str, ...]}`` per line (multi-turn: turn k is asked with the
earlier turns and their generated answers as chat history); ``--chat`` reads messages from the
terminal, keeping the history, until Ctrl-D. ``--system`` starts every conversation with a
system prompt; ``--raw`` feeds the text without the chat template. ``--stop`` (repeatable) ends
an answer before the first occurrence of the string.

Output:
  * default: the answer text streams to stdout as it is generated (one prompt at a time; EAGLE
    prints each round's tokens as the round completes), each after its prompt (``> ...`` on
    stderr) where there are several; at the end one summary line on stderr
    (:func:`eagle3_jax.cli.output.summary_line`): the mode and, for EAGLE, its tree (top-k,
    depth, tokens verified per round) and tau, the tokens/s, with ``--compare`` plain
    decoding's tokens/s, the speed-up and whether the outputs are identical, e.g.
    ``eagle (tree: top-k 2, depth 4, 6 tokens, chosen for this machine): tau 1.74, 52.3
    tokens/s; plain 30.9 tokens/s, speed-up 1.69x, outputs identical``.
  * ``--verbose``: also the diagnostics on stderr: the target's and head's loading, the tree
    chooser's timings and choice, the fallback's break-even, compilations, every prompt and
    every answer's timings (with ``--compare`` a line per turn and the totals). Without it,
    where stderr is a terminal, they show one at a time on a status line that the first
    answer clears.
  * ``--json``: one JSON object per line **per turn**, fields ``index`` (prompt line, 0-based),
    ``turn`` (0-based), ``prompt_token_ids`` (the full templated conversation fed to the model),
    ``token_ids`` (generated ids, EOS excluded), ``text``, ``new_tokens``, ``stop`` ("eos";
    "stop": a --stop string; "length": max-new-tokens reached; "context": the model context /
    KV cache filled up first), ``seconds`` (wall time of the batched generate call that
    produced it, compilation excluded), ``tokens_per_s`` and ``batch_size``. Prompts are decoded
    ``--batch-size`` at a time. EAGLE adds ``rounds`` (verification rounds),
    ``mean_accept_length`` (new tokens / rounds: a round's accepted drafts + 1, less an EOS or
    tokens past the limit; the prefill's token is not a round) and ``accept_hist`` (index j:
    rounds that emitted j tokens).

``--mode`` picks the decoder: ``vanilla`` (plain autoregressive decoding) or ``eagle`` (EAGLE-3
speculative decoding with ``--draft PATH``: a head in the released format, a folder with
config.json + model.safetensors, or a training run folder / ``checkpoints/<step>`` folder).
The default is ``eagle`` when ``--draft`` is given or the target has a shipped head (the
default SmolLM2 does: :mod:`eagle3_jax.draft.shipped`), else ``vanilla``.

The tree: ``--depth`` (levels, the root included), ``--tree-top-k`` and ``--total-tokens``
(nodes verified per round, the root included; a number or ``auto``) shape it; ``--tree-top-k``
is not ``--top-k``, which stays the sampling cut-off. Without any of the three, whichever head
drafts (shipped or ``--draft``), the tree is ``auto``: the one measured fastest on this machine
(:mod:`eagle3_jax.decoding.autotune`), modelled from ``--accept-rates`` where given, else from
the head's acceptance record (``acceptance.json`` beside a released-format head, or a training
run's eval records), else, where the head has no record, from the default profile 0.6*0.9^d,
which the summary line then says (the fallback below measures what the head really accepts on
the prompt). With ``auto``, when no tree is predicted to beat plain decoding here, it decodes
plainly and says so; when one is, the decoder measures the acceptance on the prompt itself and
gives up drafting where a round emits fewer tokens than it costs in decode steps, and resumes
where the draft's hits on the plain steps' tokens say it would pay again (the fallback,
:class:`eagle3_jax.decoding.eagle.Fallback`). ``--force-eagle`` drafts throughout. A tree flag
fixes the tree as given (only ``--depth`` / ``--tree-top-k``: every candidate the shape
proposes, up to 16 nodes), without the fallback.

``--compare`` decodes every prompt with both modes and reports both speeds, the speed-up and
whether the texts are identical.

``--dtype`` sets the target's parameter dtype, ``--mesh`` shards it over devices (e.g.
``tensor=8``). Errors the user can fix are one line on stderr and exit status 2 (``--debug``
adds the traceback); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable, Sequence

from eagle3_jax.cli.conversations import PromptFormat, check_raw, read_conversations
from eagle3_jax.cli.output import (Answers, Console, log, run_chat, run_compare, run_json,
                                   run_stream, summary_line)
from eagle3_jax.errors import UsageError, run_cli

MODES = ("vanilla", "eagle")
DEFAULT_BATCH_SIZE = 8


def parse_accept_rates(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
        raise UsageError(f"--accept-rates must be comma-separated numbers in [0, 1] "
                         f"(acceptance at depth 1, 2, ...), got {text!r}")
    return rates


def parse_total_tokens(text: str | None) -> int | str | None:
    if text is None or text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"--total-tokens must be a number or 'auto', got {text!r}") from None


def parse_mesh(text: str | None):
    """``--mesh tensor=8`` (axes data, fsdp, tensor; unnamed ones 1) -> MeshConfig or None."""
    if text is None:
        return None
    from eagle3_jax.sharding import MeshConfig

    sizes = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in ("data", "fsdp", "tensor") or not value.strip().isdigit():
            raise UsageError(f"--mesh takes AXIS=N[,AXIS=N] with axes data, fsdp, tensor "
                             f"(e.g. tensor=8), got {text!r}")
        sizes[name.strip()] = int(value)
    return MeshConfig(**{"data": 1, "fsdp": 1, "tensor": 1, **sizes})


def resolve_tree(total_tokens, tree_top_k: int | None, depth: int | None):
    """A TreeConfig from the number flags (``total_tokens`` not "auto")."""
    from eagle3_jax.decoding.tree import TreeConfig

    fields = {"tree_top_k": tree_top_k, "depth": depth, "total_tokens": total_tokens}
    default = TreeConfig()
    if total_tokens is None and (tree_top_k is not None or depth is not None):
        # Only the shape was given: verify every candidate the shape proposes, up to 16.
        k, d = tree_top_k or default.tree_top_k, depth or default.depth
        fields["total_tokens"] = min(default.total_tokens, k + (d - 1) * k * k + 1)
    return TreeConfig(**{k: v for k, v in fields.items() if v is not None})


def autotune(target, loaded_head, prompt_length: int, tree_top_k: int | None, depth: int | None,
             accept_rates: list[float] | None, batch: int = 1,
             log: Callable[[str], None] = log):
    """The autotuned TreeChoice for a padded batch of ``batch`` rows (measured costs; the
    given acceptance rates, else the head's, else the default profile 0.6*0.9^d); ``log``
    gets the chooser's diagnostics."""
    from eagle3_jax.decoding.autotune import RANKED_TREES, autotune_tree

    rates = accept_rates or loaded_head.accept_rates
    # The live calibration belongs to the head's own rates, not to rates the user gives.
    scale = None if accept_rates else loaded_head.accept_scale
    decay = 1.0 if scale is None else loaded_head.accept_decay
    choice = autotune_tree(target.params, target.cfg, loaded_head.head, prompt_length,
                           batch=batch, accept_rates=rates,
                           accept_scale=1.0 if scale is None else scale, accept_decay=decay,
                           tree_top_k=tree_top_k, depth=depth, ranked=RANKED_TREES, log=log)
    source = ("--accept-rates" if accept_rates else "the head's" if rates
              else "default profile 0.6*0.9^d")
    per_level = "" if decay == 1.0 else f" x{decay:.2f} per draft level"
    calibrated = ("" if scale is None else
                  f", extra tokens x{scale:.2f}{per_level} as the head measured live on "
                  "held-out prompts")
    log(f"[autotune ({source} acceptance rates{calibrated}): {choice.describe()}]")
    return choice


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eagle3_jax.decode",
        description="Generate answers with a target model (default: SmolLM2-135M-Instruct).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one user message (the chat template is applied)")
    src.add_argument("--prompts-file", metavar="PATH",
                     help='JSONL: {"prompt": str} or {"turns": [str, ...]} per line')
    src.add_argument("--chat", action="store_true",
                     help="interactive multi-turn chat in the terminal (Ctrl-D leaves)")
    p.add_argument("--system", metavar="TEXT", help="system prompt for every conversation")
    p.add_argument("--raw", action="store_true",
                   help="tokenize the prompt as it is, without the chat template")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the answer before this string (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sampling top-k; 0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", metavar="PATH_OR_PRESET",
                   help="preset name, HF checkpoint folder, Hugging Face hub id (org/name, "
                        "through the hub cache) or .gguf file (default: SmolLM2)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="target parameter dtype (default: the preset's, float32 for GGUF; "
                        "bfloat16 is for accelerators)")
    p.add_argument("--mesh", metavar="AXIS=N,...", default=None,
                   help="shard the target over devices, e.g. tensor=8 (axes data, fsdp, tensor)")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="vanilla or eagle (default: eagle with --draft, --compare or a target "
                        "that ships a head, with the tree chosen by measurement; else vanilla)")
    p.add_argument("--draft", metavar="PATH",
                   help="EAGLE-3 head: released-format folder or hub id (org/name), or a "
                        "training run / checkpoint")
    p.add_argument("--depth", type=int, default=None,
                   help="draft tree levels incl. the root, fixing the tree (the reference's "
                        "depth=7 is our 8). Without --depth, --tree-top-k and --total-tokens "
                        "the tree is 'auto', whichever head drafts")
    p.add_argument("--tree-top-k", type=int, default=None,
                   help="children per expanded tree node, fixing the tree (1 = a chain)")
    p.add_argument("--total-tokens", default=None,
                   help="nodes verified per round incl. the root (the reference's "
                        "total_token), or 'auto': the tree measured fastest here, with the "
                        "fallback (the default without tree flags). With only --depth / "
                        "--tree-top-k: every candidate of that shape, up to 16")
    p.add_argument("--accept-rates", default=None, metavar="A1,A2,...",
                   help="per-depth acceptance rates the auto tree is modelled from (default: "
                        "the head's record, else 0.6*0.9^d)")
    p.add_argument("--force-eagle", action="store_true",
                   help="with the auto tree, draft throughout: even where plain decoding is "
                        "predicted or measured faster")
    p.add_argument("--compare", action="store_true",
                   help="decode with vanilla and eagle; report speeds, speed-up, identical text")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"prompts decoded together with --json or --compare (default "
                        f"{DEFAULT_BATCH_SIZE}); streamed text is one prompt at a time")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per line per turn instead of streamed text")
    p.add_argument("--no-cache", action="store_true",
                   help="neither read nor write the serving-weights and compilation caches "
                        "under $EAGLE3_JAX_HOME")
    p.add_argument("--verbose", action="store_true",
                   help="also print the diagnostics: loading, the tree chooser's timings and "
                        "choice, the fallback's break-even, compilations, every prompt and "
                        "every answer's timings")
    p.add_argument("--debug", action="store_true", help="show tracebacks of user errors too")
    p.set_defaults(shipped_head=False)  # set by _check_flags when --draft is the shipped head
    return p


def main(argv: Sequence[str] | None = None, *,
         load_fn: Callable[[str | None], Any] | None = None,
         head_for: Callable[[str | None], Any] | None = None) -> int:
    """Run the CLI; returns the exit status. ``load_fn(target)`` replaces the model loader
    (tests pass a tiny random model); it must return an object like ``LoadedTarget``.
    ``head_for(target)`` gives the target's shipped head folder or None; default: the package's
    shipped heads (:func:`eagle3_jax.draft.shipped.shipped_head_for`) with the real loader, none
    with ``load_fn`` (its model is not the preset's weights)."""
    args = build_parser().parse_args(argv)
    if head_for is None:
        from eagle3_jax.draft.shipped import shipped_head_for

        head_for = shipped_head_for if load_fn is None else (lambda target: None)
    console = Console(args.verbose)

    def body() -> None:
        try:
            _run(args, load_fn, head_for, console)
        finally:
            console.answering()  # an error's line starts on a line of its own

    return run_cli(body, debug=args.debug)


def _check_flags(args: argparse.Namespace, head_for: Callable[[str | None], Any]) -> str:
    """Flag combinations, before anything loads; returns the mode. Without ``--draft`` and
    ``--mode vanilla``, the target's shipped head (``head_for``) becomes the draft. Whichever
    head drafts, the tree is chosen by measurement (``--total-tokens auto``, with the fallback)
    unless tree flags are given."""
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    streaming = not (args.json or args.compare)
    if streaming and args.batch_size not in (None, 1):
        raise UsageError("--batch-size applies to --json and --compare; streamed text decodes "
                         "one prompt at a time (add --json to decode in batches)")
    if args.chat and (args.json or args.compare):
        raise UsageError("--chat streams its answers; it does not combine with --json or "
                         "--compare")
    if args.draft is None and args.mode != "vanilla":
        shipped = head_for(args.target)
        if shipped is not None:
            args.draft = str(shipped)
            args.shipped_head = True
    mode = args.mode or ("eagle" if args.draft or args.compare else "vanilla")
    eagle = mode == "eagle" or args.compare
    draft_flag = None if args.shipped_head else args.draft
    tree_flags = [f for f, v in (("--draft", draft_flag), ("--depth", args.depth),
                                 ("--tree-top-k", args.tree_top_k),
                                 ("--total-tokens", args.total_tokens),
                                 ("--accept-rates", args.accept_rates)) if v is not None]
    if args.force_eagle:
        tree_flags.append("--force-eagle")
    if not eagle and tree_flags:
        raise UsageError(f"{', '.join(tree_flags)} only apply to --mode eagle (or --compare)")
    if args.compare and args.mode == "vanilla":
        raise UsageError("--compare runs both modes; drop --mode vanilla")
    if eagle and args.draft is None:
        raise UsageError("--mode eagle needs a draft head and this target has no shipped one: "
                         "pass --draft PATH (a released EAGLE-3 head folder or a training run "
                         "folder)")
    if eagle and args.total_tokens is None and args.tree_top_k is None and args.depth is None:
        args.total_tokens = "auto"  # whichever head drafts: the chooser's tree, the fallback
    if args.force_eagle and args.total_tokens != "auto":
        raise UsageError("--force-eagle only applies to the auto tree: drop --depth, "
                         "--tree-top-k and --total-tokens N, or --force-eagle")
    parse_mesh(args.mesh)
    return mode


def _padded_batch(args, conversations) -> int:
    """The rows of the first decoding batch (padded to a power of two, as the decoders pad):
    1 when streaming or chatting, else up to --batch-size prompts."""
    from eagle3_jax.decoding.batching import bucket

    if not (args.json or args.compare):
        return 1
    return bucket(min(args.batch_size or DEFAULT_BATCH_SIZE, max(len(conversations), 1)), 1)


def _load_target(args, load_fn, log: Callable[[str], None]):
    start = time.perf_counter()
    if load_fn is not None:
        target = load_fn(args.target)
    else:
        from eagle3_jax.checkpoints import load_target

        mesh = None
        mesh_cfg = parse_mesh(args.mesh)
        if mesh_cfg is not None:
            import jax

            from eagle3_jax.sharding import make_mesh

            needed = mesh_cfg.data * mesh_cfg.fsdp * mesh_cfg.tensor
            devices = jax.devices()
            if needed > len(devices):
                raise UsageError(f"--mesh {args.mesh} needs {needed} devices but "
                                 f"{len(devices)} are present")
            mesh = make_mesh(mesh_cfg, devices[:needed])
        target = load_target(args.target, mesh=mesh, dtype=args.dtype,
                             weights_cache=not args.no_cache)
    log(f"[loaded {target.source} ({target.cfg.arch}, {target.cfg.num_params / 1e6:.0f}M "
        f"params) in {time.perf_counter() - start:.1f} s]")
    return target


def _run(args: argparse.Namespace, load_fn: Callable | None, head_for: Callable,
         console: Console) -> None:
    from eagle3_jax.decoding.sampling import sampling_from_flags
    from eagle3_jax.decoding.decoders import CompileCache, EagleDecoder, PlainDecoder

    mode = _check_flags(args, head_for)
    if not args.no_cache:
        from eagle3_jax.compile_cache import enable_compile_cache

        enable_compile_cache()
    eagle = mode == "eagle" or args.compare
    total_tokens = parse_total_tokens(args.total_tokens)
    accept_rates = parse_accept_rates(args.accept_rates)
    tree = None
    if eagle and total_tokens != "auto":  # impossible sizes fail before any loading
        tree = resolve_tree(total_tokens, args.tree_top_k, args.depth)
    sampling = sampling_from_flags(args.temperature, args.top_p, args.top_k)
    conversations = [] if args.chat else read_conversations(args.prompt, args.prompts_file)
    check_raw(args.raw, conversations, args.system, args.chat)
    if eagle:
        from eagle3_jax.draft.load import check_head_path

        check_head_path(args.draft)  # before the target loads

    target = _load_target(args, load_fn, console)
    fmt = PromptFormat(target.tokenizer, target.cfg.max_position_embeddings, args.system,
                       args.raw)
    answers = Answers(target.tokenizer, args.max_new_tokens, tuple(args.stop))
    cache = CompileCache(console)
    decoders = {}
    fallback = None  # the auto tree's: give up drafting where the prompt's acceptance is low
    how = ""  # how the tree was chosen, for the summary line
    plainly = False  # the chooser found no tree worth drafting here
    if eagle:
        from eagle3_jax.draft.load import load_head

        loaded = load_head(args.draft, target.cfg).serving()
        console(f"[draft head: {loaded.description}; draft vocabulary "
                f"{loaded.head.cfg.draft_vocab_size}]")
        if tree is None:
            first = fmt.prompt_ids(fmt.new_history() + [
                {"role": "user", "content": conversations[0][0] if conversations else "Hi"}],
                "prompt 0")
            choice = autotune(target, loaded, len(first), args.tree_top_k, args.depth,
                              accept_rates, batch=_padded_batch(args, conversations),
                              log=console)
            tree = choice.tree
            how = ", chosen for this machine"
            if accept_rates is None and loaded.accept_rates is None:
                how += (" at the default acceptance rates 0.6*0.9^d (the head has no "
                        "acceptance record)")
            if not choice.pays_off and not (args.force_eagle or args.compare):
                console("[decoding plainly: no draft tree is predicted to beat plain decoding "
                        "on this machine (--force-eagle keeps EAGLE)]")
                mode, eagle, plainly = "vanilla", False, True
            elif not choice.pays_off and not args.force_eagle:
                how += (", predicted not to beat plain decoding here: without --compare it "
                        "decodes plainly")
            if eagle and not args.force_eagle:
                from eagle3_jax.decoding.autotune import fallback_for

                fallback = fallback_for(target.params, target.cfg, loaded.head, tree,
                                        log=console)
    if eagle:
        console(f"[draft tree: top_k={tree.tree_top_k} depth={tree.depth} "
                f"total_tokens={tree.total_tokens}]")
        decoders["eagle"] = EagleDecoder(target, sampling, args.max_new_tokens, args.seed,
                                         head=loaded.head, tree=tree, compile_cache=cache,
                                         fallback=fallback)
    if mode == "vanilla" or args.compare:
        decoders["vanilla"] = PlainDecoder(target, sampling, args.max_new_tokens, args.seed,
                                           compile_cache=cache)
    batch_size = args.batch_size or DEFAULT_BATCH_SIZE
    plain = identical = None
    if args.compare:
        tally, plain, identical = run_compare(conversations, fmt, decoders, batch_size, answers,
                                              args.json, console)
    elif args.chat:
        tally = run_chat(fmt, decoders[mode], answers, console)
    elif args.json:
        tally = run_json(conversations, fmt, decoders[mode], batch_size, answers, console)
    else:
        tally = run_stream(conversations, fmt, decoders[mode], answers, console)
    if eagle:
        label = (f"eagle (tree: top-k {tree.tree_top_k}, depth {tree.depth}, "
                 f"{tree.total_tokens} tokens{how})")
    else:
        label = ("vanilla (no draft tree is predicted to beat plain decoding on this machine; "
                 "--force-eagle drafts)" if plainly else "vanilla")
    console.show(summary_line(label, tally, drafting=eagle, plain=plain, identical=identical))


if __name__ == "__main__":
    sys.exit(main())
