"""Command-line decoder: ``python -m eagle3_jax.decode``.

With no arguments it loads the default target (SmolLM2-135M-Instruct) and streams the answer to
a built-in example question. ``--prompt`` asks one question; ``--prompts-file`` reads JSONL, one
``{"prompt": str}`` or ``{"turns": [str, ...]}`` per line (multi-turn: turn k is asked with the
earlier turns and their generated answers as chat history).

Output:
  * default: the answer text streams to stdout as it is generated (one prompt at a time); the
    prompt echo and timings go to stderr.
  * ``--json``: one JSON object per line **per turn** (a single-turn prompt gives one line),
    fields ``index`` (prompt line, 0-based), ``turn`` (0-based), ``prompt_token_ids`` (the full
    templated conversation fed to the model), ``token_ids`` (generated ids, EOS excluded),
    ``text``, ``new_tokens``, ``stop`` ("eos" or "length"), ``seconds`` (wall time of the batched
    generate call that produced it, compilation excluded), ``tokens_per_s`` (new_tokens /
    seconds) and ``batch_size``. Prompts are decoded ``--batch-size`` at a time.

Errors the user can fix (missing file, bad JSONL line, prompt longer than the context, bad
sampling parameters, unknown target) are one line on stderr and exit status 2.

``--mode`` picks the decoder; only ``vanilla`` (plain autoregressive decoding) exists so far. A new
mode is a class with ``generate_batch`` and ``stream`` registered in :data:`DECODERS`.
"""

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
        self._compiled: dict[tuple[int, ...], Callable] = {}

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

    def generate_batch(self, prompts: Sequence[list[int]]) -> list[Generation]:
        batch = self._pad(prompts, pad_batch=True)
        shape = batch.tokens.shape
        run = self._compiled.get(shape)
        if run is None:
            start = time.perf_counter()
            run = self._compile_generate(self.target.params, self.target.cfg, batch.tokens,
                                         batch.lengths, **self._settings())
            self._compiled[shape] = run
            log(f"[compiled generate for batch {shape[0]} x {shape[1]} prompt slots in "
                f"{time.perf_counter() - start:.1f} s]")
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


DECODERS: dict[str, type] = {"vanilla": VanillaDecoder}


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
    p.add_argument("--mode", choices=sorted(DECODERS), default="vanilla")
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
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
    conversations = read_conversations(args)

    start = time.perf_counter()
    target = load_fn(args.target)
    log(f"[loaded {target.source} ({target.cfg.arch}, {target.cfg.num_params / 1e6:.0f}M "
        f"params) in {time.perf_counter() - start:.1f} s]")
    decoder = DECODERS[args.mode](target, sampling, args.max_new_tokens, args.seed)
    if args.json:
        _run_json(conversations, target, decoder, args.batch_size)
    else:
        _run_stream(conversations, target, decoder)


def _check_length(ids: list[int], cfg, index: int, turn: int) -> None:
    context = cfg.max_position_embeddings
    if len(ids) > context:
        raise CLIError(f"prompt {index} (turn {turn}) is {len(ids)} tokens but the model context "
                       f"is {context}; shorten the prompt or drop earlier turns")


def _run_json(conversations: list[list[str]], target, decoder, batch_size: int) -> None:
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
            for i, prompt, gen in zip(rows, prompts, decoder.generate_batch(prompts)):
                text = tok.decode(gen.token_ids, skip_special_tokens=True)
                histories[i].append({"role": "assistant", "content": text})
                record = {
                    "index": i, "turn": turn, "prompt_token_ids": prompt,
                    "token_ids": gen.token_ids, "text": text, "new_tokens": len(gen.token_ids),
                    "stop": "eos" if gen.hit_eos else "length", "seconds": round(gen.seconds, 4),
                    "tokens_per_s": round(len(gen.token_ids) / max(gen.seconds, 1e-9), 2),
                    "batch_size": len(rows),
                }
                print(json.dumps(record, ensure_ascii=False), flush=True)


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
            log(f"[{count} tokens in {end - start:.2f} s; first token after "
                f"{(first_at or end) - start:.2f} s (prefill, compilation on first use); "
                f"decoding {rate:.1f} tokens/s]")


if __name__ == "__main__":
    sys.exit(main())
