"""Command-line decoder: ``python -m eagle3_jax.decode``.

With no arguments it loads the default target (SmolLM2-135M-Instruct) and streams the answer to
a built-in example question. ``--prompt`` asks one question; ``--prompts-file`` reads JSONL, one
``{"prompt": str}`` or ``{"turns": [str, ...]}`` per line (multi-turn: turn k is asked with the
earlier turns and their generated answers as chat history).

Output:
  * default: the answer text streams to stdout as it is generated (one prompt at a time; EAGLE
    prints each round's tokens as the round completes); the prompt echo and timings go to
    stderr.
  * ``--json``: one JSON object per line **per turn** (a single-turn prompt gives one line),
    fields ``index`` (prompt line, 0-based), ``turn`` (0-based), ``prompt_token_ids`` (the full
    templated conversation fed to the model), ``token_ids`` (generated ids, EOS excluded),
    ``text``, ``new_tokens``, ``stop`` ("eos"; "length": max-new-tokens reached; "context": the
    model context / KV cache filled up first), ``seconds`` (wall time of the batched generate
    call that produced it, compilation excluded), ``tokens_per_s`` (new_tokens / seconds) and
    ``batch_size``. Prompts are decoded ``--batch-size`` at a time. EAGLE adds ``rounds``
    (verification rounds), ``mean_accept_length`` (tokens per round, accepted drafts + 1, from
    ``accept_hist``; the prefill's token is not a round) and ``accept_hist``
    (index j: rounds that emitted j tokens, i.e. accepted j - 1 drafts).

``--mode`` picks the decoder: ``vanilla`` (plain autoregressive decoding, the default while no
draft head ships) or ``eagle`` (EAGLE-3 speculative decoding with ``--draft PATH``: a head in
the released format, a folder with config.json + model.safetensors, or a training run folder /
``checkpoints/<step>`` folder). ``--depth``, ``--tree-top-k`` and ``--total-tokens`` (a number
or ``auto``, see :mod:`eagle3_jax.decoding.autotune`) shape the draft tree; ``--tree-top-k`` is
not ``--top-k``, which stays the sampling cut-off. ``--compare`` decodes every prompt with
both modes and reports both speeds, the speed-up and whether the texts are identical.

Errors the user can fix (missing file, bad JSONL line, prompt longer than the context, bad
sampling parameters, unknown target, a draft head that does not fit the target, impossible tree
sizes) are one line on stderr and exit status 2.

A new mode is a class with ``generate_batch`` and ``stream`` registered in :data:`DECODERS`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

EXAMPLE_PROMPT = "What are three good reasons to learn a second language? Answer briefly."


class CLIError(ValueError):
    """A problem with the command line or its inputs; printed as one line, no traceback."""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- prompts


def read_conversations(args: argparse.Namespace) -> list[list[str]]:
    """The user turns of every conversation to decode (a single prompt is one 1-turn list)."""
    if args.prompt is not None:
        return [[args.prompt]]
    if args.prompts_file is None:
        return [[EXAMPLE_PROMPT]]
    path = Path(args.prompts_file)
    if not path.is_file():
        raise CLIError(f"prompts file {str(path)!r} does not exist")
    conversations = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            conversations.append(_parse_line(line, number, path))
    if not conversations:
        raise CLIError(f"prompts file {str(path)!r} has no prompts")
    return conversations


def _parse_line(line: str, number: int, path: Path) -> list[str]:
    where = f"{path}:{number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise CLIError(f"{where}: line {number} is not valid JSON ({e.msg})") from None
    if isinstance(item, dict) and isinstance(item.get("prompt"), str):
        return [item["prompt"]]
    turns = item.get("turns") if isinstance(item, dict) else None
    if isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns):
        return list(turns)
    raise CLIError(f'{where}: line {number} must be {{"prompt": str}} or {{"turns": [str, ...]}}')


# ---------------------------------------------------------------- decoders


@dataclasses.dataclass
class Generation:
    token_ids: list[int]
    hit_eos: bool
    seconds: float
    rounds: int | None = None  # EAGLE only
    accept_hist: list[int] | None = None

    def eagle_fields(self) -> dict:
        if self.rounds is None:
            return {}
        from eagle3_jax.decoding.acceptance import mean_accept_length

        return {"rounds": self.rounds,
                "mean_accept_length": round(mean_accept_length(self.accept_hist), 4),
                "accept_hist": self.accept_hist}


# Compiled generate functions, shared by every decoder of the process (tests and --compare make
# several decoders): key = everything static about the call.
_COMPILED: dict[tuple, Callable] = {}


def _cached_compile(key: tuple, what: str, shape, compile_fn: Callable[[], Callable]):
    """The compiled function for ``key``, compiling (and logging the time) on first use."""
    run = _COMPILED.get(key)
    if run is None:
        start = time.perf_counter()
        run = _COMPILED[key] = compile_fn()
        log(f"[compiled {what} for batch {shape[0]} x {shape[1]} prompt slots in "
            f"{time.perf_counter() - start:.1f} s]")
    return run


class IncrementalText:
    """Turns a growing token list into printable text pieces, holding back partial UTF-8.

    Byte-level tokenizers can split one character over several tokens; until the rest arrives
    the decoded text ends in U+FFFD, so nothing past the last complete character is emitted.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._printed = 0

    def push(self, token: int) -> str:
        self._ids.append(token)
        text = self._decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        return self._take(text)

    def flush(self) -> str:
        """Whatever is left (a dangling partial character prints as U+FFFD)."""
        return self._take(self.text)

    @property
    def text(self) -> str:
        return self._decode(self._ids)

    def _take(self, text: str) -> str:
        piece = text[self._printed:]
        self._printed = max(self._printed, len(text))
        return piece


class VanillaDecoder:
    """Plain autoregressive decoding with :mod:`eagle3_jax.decoding`."""

    def __init__(self, target: Any, sampling: Any, max_new_tokens: int, seed: int):
        import jax

        from eagle3_jax.decoding import compile_generate, generate_stream, pad_prompts

        self._jax, self._pad_prompts = jax, pad_prompts
        self._compile_generate, self._generate_stream = compile_generate, generate_stream
        self.target, self.sampling, self.max_new_tokens = target, sampling, max_new_tokens
        self._key = jax.random.PRNGKey(seed)
        self._calls = 0

    def _next_key(self):
        self._calls += 1
        return self._jax.random.fold_in(self._key, self._calls)

    def _settings(self) -> dict:
        return dict(max_new_tokens=self.max_new_tokens, sampling=self.sampling,
                    eos_token_ids=self.target.tokenizer.eos_token_ids)

    def _pad(self, prompts: Sequence[list[int]], pad_batch: bool):
        cfg, tok = self.target.cfg, self.target.tokenizer
        return self._pad_prompts(prompts, pad_id=tok.pad_token_id, pad_batch=pad_batch,
                                 max_length=cfg.max_position_embeddings)

    def _compiled(self, batch) -> Callable:
        settings = self._settings()
        return _cached_compile(
            ("vanilla", self.target.cfg, batch.tokens.shape, tuple(sorted(settings.items()))),
            "generate", batch.tokens.shape,
            lambda: self._compile_generate(self.target.params, self.target.cfg, batch.tokens,
                                           batch.lengths, **settings))

    def generate_batch(self, prompts: Sequence[list[int]]) -> list[Generation]:
        batch = self._pad(prompts, pad_batch=True)
        run = self._compiled(batch)
        start = time.perf_counter()
        out = self._jax.device_get(run(self.target.params, batch.tokens, batch.lengths,
                                       self._next_key()))
        seconds = time.perf_counter() - start
        return [Generation(out.tokens[i, : out.num_generated[i]].tolist(), bool(out.hit_eos[i]),
                           seconds) for i in range(batch.num_prompts)]

    def stream(self, prompt: list[int]) -> Iterator[int]:
        batch = self._pad([prompt], pad_batch=False)
        for step in self._generate_stream(self.target.params, self.target.cfg, batch.tokens,
                                          batch.lengths, key=self._next_key(),
                                          **self._settings()):
            if step[0] >= 0:
                yield int(step[0])


class EagleDecoder(VanillaDecoder):
    """EAGLE-3 speculative decoding (:mod:`eagle3_jax.decoding.eagle`) with ``head`` and ``tree``.

    The KV cache holds prompt + max_new_tokens + one tree, capped at the model context; a row
    whose cache cannot take another tree stops there (reported as stop "context").
    """

    def __init__(self, target: Any, sampling: Any, max_new_tokens: int, seed: int, *,
                 head: Any = None, tree: Any = None):
        super().__init__(target, sampling, max_new_tokens, seed)
        if head is None:
            raise CLIError("--mode eagle needs a draft head: no default head ships yet; pass "
                           "--draft PATH (a released EAGLE-3 head folder or a training run)")
        from eagle3_jax.decoding import eagle

        self._eagle = eagle
        self.head, self.tree = head, tree or eagle.TreeConfig()

    def _eagle_settings(self, width: int) -> dict:
        max_len = self._eagle.eagle_cache_size(self.target.cfg, width, self.max_new_tokens,
                                               self.tree)
        return dict(self._settings(), tree=self.tree, max_len=max_len)

    def _compiled(self, batch) -> Callable:
        shape = batch.tokens.shape
        settings = self._eagle_settings(shape[1])
        return _cached_compile(
            ("eagle", self.target.cfg, self.head.cfg, shape, tuple(sorted(settings.items()))),
            "EAGLE generate", shape,
            lambda: self._eagle.compile_generate_eagle(self.target.params, self.target.cfg,
                                                       self.head, batch.tokens, batch.lengths,
                                                       **settings))

    def generate_batch(self, prompts: Sequence[list[int]]) -> list[Generation]:
        batch = self._pad(prompts, pad_batch=True)
        run = self._compiled(batch)
        start = time.perf_counter()
        out = self._jax.device_get(run(self.target.params, self.head, batch.tokens,
                                       batch.lengths, self._next_key()))
        seconds = time.perf_counter() - start
        return [Generation(out.tokens[i, : out.num_generated[i]].tolist(), bool(out.hit_eos[i]),
                           seconds, int(out.rounds[i]), out.accept_hist[i].tolist())
                for i in range(batch.num_prompts)]

    def stream(self, prompt: list[int]) -> Iterator[int]:
        batch = self._pad([prompt], pad_batch=False)
        self.last_rounds = -1  # the prefill step is not a round
        for step in self._eagle.generate_eagle_stream(
                self.target.params, self.target.cfg, self.head, batch.tokens, batch.lengths,
                key=self._next_key(), **self._eagle_settings(batch.tokens.shape[1])):
            self.last_rounds += 1
            yield from (int(t) for t in step[0])


DECODERS: dict[str, type] = {"vanilla": VanillaDecoder, "eagle": EagleDecoder}


# ---------------------------------------------------------------- draft heads


def load_draft(path: str, target_cfg) -> tuple[Any, list[float] | None, str]:
    """(DraftHead, its measured per-depth acceptance rates or None, description) of ``path``.

    ``path`` is a released-format folder (config.json + weights), a training run folder (with
    ``checkpoints/``), its ``checkpoints/`` folder, or one ``checkpoints/<step>`` folder. The
    rates are the latest eval (else train) ``acc_per_step`` of a run's ``metrics.jsonl``.
    """
    folder = Path(path)
    if not folder.exists():
        raise CLIError(f"draft head {path!r} does not exist; give a released EAGLE-3 head folder "
                       "(config.json + model.safetensors) or a training run folder")
    if (folder / "config.json").is_file():
        from eagle3_jax.draft.export import load_draft_head

        return load_draft_head(folder, target_cfg), None, f"released-format head {folder}"
    step = None
    if folder.name.isdigit() and folder.parent.name == "checkpoints":
        step, folder = int(folder.name), folder.parent.parent
    elif folder.name == "checkpoints":
        folder = folder.parent
    if not (folder / "checkpoints").is_dir():
        raise CLIError(f"draft head {path!r} is neither a released EAGLE-3 head folder "
                       "(config.json + model.safetensors) nor a training run folder "
                       "(checkpoints/)")
    from eagle3_jax.train.loop import METRICS_FILE, load_trained_head
    from eagle3_jax.train.metrics import read_metrics

    head, step = load_trained_head(folder, step)
    head.cfg.check_fits(target_cfg)
    records = [r for r in read_metrics(folder / METRICS_FILE) if r.get("acc_per_step")]
    rates = None
    for kind in ("eval", "train"):
        found = [r for r in records if r.get("kind") == kind and r.get("step", 0) <= step]
        if found:
            rates = [float(a) for a in found[-1]["acc_per_step"]]
            break
    return head, rates, f"training run {folder} step {step}"


def parse_accept_rates(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
        raise CLIError(f"--accept-rates must be comma-separated numbers in [0, 1] (acceptance "
                       f"at depth 1, 2, ...), got {text!r}")
    return rates


def parse_total_tokens(text: str | None) -> int | str | None:
    if text is None or text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise CLIError(f"--total-tokens must be a number or 'auto', got {text!r}") from None


def resolve_tree(total_tokens, top_k: int | None, depth: int | None, *, target=None, head=None,
                 prompt_length: int = 0, accept_rates=None, rates_source: str = "given"):
    """A TreeConfig from the flags; ``total_tokens="auto"`` measures and picks (autotune)."""
    from eagle3_jax.decoding.tree import TreeConfig

    if total_tokens != "auto":
        fields = {"top_k": top_k, "depth": depth, "total_tokens": total_tokens}
        default = TreeConfig()
        if total_tokens is None and (top_k is not None or depth is not None):
            # Only the shape was given: verify every candidate the shape proposes, up to 16.
            k, d = top_k or default.top_k, depth or default.depth
            fields["total_tokens"] = min(default.total_tokens, k + (d - 1) * k * k + 1)
        return TreeConfig(**{k: v for k, v in fields.items() if v is not None})
    from eagle3_jax.decoding.autotune import autotune_tree

    choice = autotune_tree(target.params, target.cfg, head, prompt_length,
                           accept_rates=accept_rates, top_k=top_k, depth=depth, log=log)
    source = rates_source if accept_rates else "default profile 0.6*0.9^d"
    log(f"[autotune ({source} acceptance rates): {choice.describe()}]")
    return choice.tree


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eagle3_jax.decode",
        description="Generate answers with a target model (default: SmolLM2-135M-Instruct).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one user message (the chat template is applied)")
    src.add_argument("--prompts-file", metavar="PATH",
                     help='JSONL: {"prompt": str} or {"turns": [str, ...]} per line')
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", metavar="PATH_OR_PRESET",
                   help="preset name, HF checkpoint folder or .gguf file (default: SmolLM2)")
    p.add_argument("--mode", choices=sorted(DECODERS), default=None,
                   help="vanilla (default; eagle once a default head ships) or eagle; --draft "
                        "or --compare alone select eagle")
    p.add_argument("--draft", metavar="PATH",
                   help="EAGLE-3 head: released-format folder or training run / checkpoint")
    p.add_argument("--depth", type=int, default=None, help="draft tree depth (default 4)")
    p.add_argument("--tree-top-k", type=int, default=None,
                   help="children per expanded tree node (default 4; 1 = a chain)")
    p.add_argument("--total-tokens", default=None,
                   help="tokens verified per round incl. the root (default 16), or 'auto'")
    p.add_argument("--accept-rates", default=None, metavar="A1,A2,...",
                   help="per-depth acceptance rates for --total-tokens auto (default: the "
                        "head's measured ones, else 0.6*0.9^d)")
    p.add_argument("--compare", action="store_true",
                   help="decode with vanilla and eagle; report speeds, speed-up, identical text")
    p.add_argument("--batch-size", type=int, default=8,
                   help="prompts decoded together with --json (default 8)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per line per turn instead of streamed text")
    return p


def _default_loader(target: str | None):
    from eagle3_jax.checkpoints import load_target

    return load_target(target)


def main(argv: Sequence[str] | None = None, *,
         load_fn: Callable[[str | None], Any] | None = None) -> int:
    """Run the CLI; returns the exit status. ``load_fn(target)`` replaces the model loader
    (tests pass a tiny random model); it must return an object like ``LoadedTarget``."""
    args = build_parser().parse_args(argv)
    try:
        _run(args, load_fn or _default_loader)
    except CLIError as e:
        log(f"error: {e}")
        return 2
    except (ValueError, OSError, RuntimeError) as e:
        # Our loaders and validators raise ValueError subclasses (and ModelUnavailableError)
        # whose messages already say what to change.
        log(f"error: {type(e).__name__}: {e}")
        return 2
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    return 0


def _run(args: argparse.Namespace, load_fn: Callable) -> None:
    from eagle3_jax.decoding import SamplingParams

    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {args.batch_size}")
    mode = args.mode or ("eagle" if args.draft or args.compare else "vanilla")
    eagle = mode == "eagle" or args.compare
    tree_flags = [f for f, v in (("--draft", args.draft), ("--depth", args.depth),
                                 ("--tree-top-k", args.tree_top_k),
                                 ("--total-tokens", args.total_tokens),
                                 ("--accept-rates", args.accept_rates)) if v is not None]
    if not eagle and tree_flags:
        raise CLIError(f"{', '.join(tree_flags)} only apply to --mode eagle (or --compare)")
    if args.compare and args.mode == "vanilla":
        raise CLIError("--compare runs both modes; drop --mode vanilla")
    if eagle and args.draft is None:
        raise CLIError("--mode eagle needs a draft head, and no default head ships yet: pass "
                       "--draft PATH (a released EAGLE-3 head folder or a training run folder)")
    total_tokens = parse_total_tokens(args.total_tokens)
    accept_rates = parse_accept_rates(args.accept_rates)
    tree = None
    if eagle and total_tokens != "auto":  # impossible sizes fail before any loading
        tree = resolve_tree(total_tokens, args.tree_top_k, args.depth)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
    conversations = read_conversations(args)

    start = time.perf_counter()
    target = load_fn(args.target)
    log(f"[loaded {target.source} ({target.cfg.arch}, {target.cfg.num_params / 1e6:.0f}M "
        f"params) in {time.perf_counter() - start:.1f} s]")
    decoders = {}
    if mode == "vanilla" or args.compare:
        decoders["vanilla"] = VanillaDecoder(target, sampling, args.max_new_tokens, args.seed)
    if eagle:
        head, rates, description = load_draft(args.draft, target.cfg)
        log(f"[draft head: {description}; draft vocabulary {head.cfg.draft_vocab_size}]")
        if tree is None:
            first = target.tokenizer.apply_chat_template(
                [{"role": "user", "content": conversations[0][0]}], add_generation_prompt=True)
            tree = resolve_tree("auto", args.tree_top_k, args.depth, target=target, head=head,
                                prompt_length=len(first), accept_rates=accept_rates or rates,
                                rates_source="--accept-rates" if accept_rates else "the head's")
        log(f"[draft tree: top_k={tree.top_k} depth={tree.depth} "
            f"total_tokens={tree.total_tokens}]")
        decoders["eagle"] = EagleDecoder(target, sampling, args.max_new_tokens, args.seed,
                                         head=head, tree=tree)
    if args.compare:
        _run_compare(conversations, target, decoders, args.batch_size, args.max_new_tokens,
                     args.json)
    elif args.json:
        _run_json(conversations, target, decoders[mode], args.batch_size, args.max_new_tokens)
    else:
        _run_stream(conversations, target, decoders[mode])


def _stop(gen: Generation, max_new_tokens: int) -> str:
    if gen.hit_eos:
        return "eos"
    return "length" if len(gen.token_ids) >= max_new_tokens else "context"


def _check_length(ids: list[int], cfg, index: int, turn: int) -> None:
    context = cfg.max_position_embeddings
    if len(ids) > context:
        raise CLIError(f"prompt {index} (turn {turn}) is {len(ids)} tokens but the model context "
                       f"is {context}; shorten the prompt or drop earlier turns")


def _decode_turns(conversations: list[list[str]], target, batch_size: int,
                  generate: Callable[[list[list[int]]], list[Any]],
                  answer_text: Callable[[Any], str], emit: Callable) -> None:
    """Batches of conversations, turn by turn; turn k's prompt holds the earlier answers.

    ``generate(prompts) -> results``; ``answer_text(result)`` is what enters the history;
    ``emit(index, turn, prompt, result, rows_in_batch)`` reports one turn.
    """
    tok = target.tokenizer
    for first in range(0, len(conversations), batch_size):
        group = list(range(first, min(first + batch_size, len(conversations))))
        histories: dict[int, list[dict[str, str]]] = {i: [] for i in group}
        for turn in range(max(len(conversations[i]) for i in group)):
            rows = [i for i in group if turn < len(conversations[i])]
            prompts = []
            for i in rows:
                histories[i].append({"role": "user", "content": conversations[i][turn]})
                prompts.append(tok.apply_chat_template(histories[i], add_generation_prompt=True))
                _check_length(prompts[-1], target.cfg, i, turn)
            for i, prompt, result in zip(rows, prompts, generate(prompts)):
                histories[i].append({"role": "assistant", "content": answer_text(result)})
                emit(i, turn, prompt, result, len(rows))


def _record(gen: Generation, text: str, max_new_tokens: int) -> dict:
    return {"token_ids": gen.token_ids, "text": text, "new_tokens": len(gen.token_ids),
            "stop": _stop(gen, max_new_tokens), "seconds": round(gen.seconds, 4),
            "tokens_per_s": round(len(gen.token_ids) / max(gen.seconds, 1e-9), 2),
            **gen.eagle_fields()}


def _run_json(conversations: list[list[str]], target, decoder, batch_size: int,
              max_new_tokens: int) -> None:
    tok = target.tokenizer
    text = lambda gen: tok.decode(gen.token_ids, skip_special_tokens=True)  # noqa: E731

    def emit(i, turn, prompt, gen, rows):
        record = {"index": i, "turn": turn, "prompt_token_ids": prompt,
                  **_record(gen, text(gen), max_new_tokens), "batch_size": rows}
        print(json.dumps(record, ensure_ascii=False), flush=True)

    _decode_turns(conversations, target, batch_size, decoder.generate_batch, text, emit)


def _run_compare(conversations: list[list[str]], target, decoders: dict, batch_size: int,
                 max_new_tokens: int, as_json: bool) -> None:
    """Both modes on the same prompts (the history takes EAGLE's answer); per turn a line, then
    the totals: tokens/s of each (tokens / seconds over all batches), speed-up, identical."""
    tok = target.tokenizer
    text = lambda gen: tok.decode(gen.token_ids, skip_special_tokens=True)  # noqa: E731
    totals = {name: {"tokens": 0, "seconds": 0.0} for name in ("vanilla", "eagle")}
    rounds, turns, identical, hist = 0, 0, 0, []

    def generate(prompts):
        pairs = {}
        for name in ("vanilla", "eagle"):
            gens = decoders[name].generate_batch(prompts)
            totals[name]["tokens"] += sum(len(g.token_ids) for g in gens)
            totals[name]["seconds"] += gens[0].seconds  # one batched call
            pairs[name] = gens
        return list(zip(pairs["vanilla"], pairs["eagle"]))

    def emit(i, turn, prompt, pair, rows):
        nonlocal rounds, turns, identical, hist
        plain, spec = pair
        same = plain.token_ids == spec.token_ids
        rounds, turns, identical = rounds + spec.rounds, turns + 1, identical + same
        hist = [a + b for a, b in zip(hist or [0] * len(spec.accept_hist), spec.accept_hist)]
        eagle_record = _record(spec, text(spec), max_new_tokens)
        plain_record = _record(plain, text(plain), max_new_tokens)
        if as_json:
            record = {"index": i, "turn": turn, "prompt_token_ids": prompt, **eagle_record,
                      "batch_size": rows, "identical": same,
                      "speedup": round(eagle_record["tokens_per_s"]
                                       / max(plain_record["tokens_per_s"], 1e-9), 3),
                      "vanilla": plain_record}
            print(json.dumps(record, ensure_ascii=False), flush=True)
        else:
            log(f"> {conversations[i][turn]}")
            print(eagle_record["text"], flush=True)
            log(f"[prompt {i} turn {turn}: vanilla {plain_record['tokens_per_s']:.1f} tokens/s, "
                f"eagle {eagle_record['tokens_per_s']:.1f} tokens/s, mean accept length "
                f"{eagle_record['mean_accept_length']:.2f}, identical: {'yes' if same else 'NO'}]")

    _decode_turns(conversations, target, batch_size, generate, lambda pair: text(pair[1]), emit)
    speed = {name: t["tokens"] / max(t["seconds"], 1e-9) for name, t in totals.items()}
    from eagle3_jax.decoding.acceptance import mean_accept_length

    tau = mean_accept_length(hist)
    summary = (f"compare: vanilla {speed['vanilla']:.1f} tokens/s, eagle {speed['eagle']:.1f} "
               f"tokens/s, speed-up {speed['eagle'] / max(speed['vanilla'], 1e-9):.2f}x; "
               f"mean accept length {tau:.2f} over {rounds} rounds; identical texts "
               f"{identical}/{turns}")
    if as_json:
        log(summary)  # stdout stays one JSON object per turn
    else:
        print(summary, flush=True)


def _run_stream(conversations: list[list[str]], target, decoder) -> None:
    tok = target.tokenizer
    for index, turns in enumerate(conversations):
        history: list[dict[str, str]] = []
        for turn, user in enumerate(turns):
            history.append({"role": "user", "content": user})
            prompt = tok.apply_chat_template(history, add_generation_prompt=True)
            _check_length(prompt, target.cfg, index, turn)
            log(f"> {user}")
            text = IncrementalText(lambda ids: tok.decode(ids, skip_special_tokens=True))
            start = time.perf_counter()
            # The first token comes with the prefill, the second after the decode step's
            # compilation (first use only): the rate is measured from the second on.
            first_at = second_at = None
            count = 0
            for token in decoder.stream(prompt):
                count += 1
                if count == 1:
                    first_at = time.perf_counter()
                elif count == 2:
                    second_at = time.perf_counter()
                sys.stdout.write(text.push(token))
                sys.stdout.flush()
            sys.stdout.write(text.flush() + "\n")
            sys.stdout.flush()
            history.append({"role": "assistant", "content": text.text})
            end = time.perf_counter()
            rate = (count - 2) / (end - second_at) if count > 2 and end > second_at else 0.0
            rounds = getattr(decoder, "last_rounds", None)
            extra = (f"; {rounds} rounds, mean accept length {count / max(rounds, 1):.2f}"
                     if rounds is not None else "")
            log(f"[{count} tokens in {end - start:.2f} s; first token after "
                f"{(first_at or end) - start:.2f} s (prefill, compilation on first use); "
                f"decoding {rate:.1f} tokens/s{extra}]")


if __name__ == "__main__":
    sys.exit(main())
