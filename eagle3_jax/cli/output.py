"""What the decoder CLI prints: streamed text, JSON lines, a plain-vs-EAGLE compare, a chat.

Answers go to stdout (streamed as they are generated, or one JSON object per line); stderr gets
one summary line at the end (:func:`summary_line`) and, with ``--verbose``, the diagnostics
(:class:`Console`). Every report of acceptance uses one definition: new tokens / verification
rounds, where the prefill's first token is not a round and nothing after an EOS, a stop string
or the token limit counts.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from typing import Any, Callable, Sequence, TextIO

from eagle3_jax.cli.conversations import PromptFormat, decode_turns
from eagle3_jax.decoding.acceptance import mean_accept_length
from eagle3_jax.decoding.decoders import Generation
from eagle3_jax.errors import UsageError
from eagle3_jax.text.incremental import IncrementalText


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Console:
    """The decoder's messages on stderr. ``show(line)``: a line a person always sees (the
    summary, prompt echoes between several answers). Calling it with a diagnostic (the target's
    and head's loading, the tree chooser's timings and choice, the fallback's break-even,
    compilations, per-answer timings; it is the ``log=`` callback the chooser gets) prints the
    line with ``verbose``; without it the line shows only where stderr is a terminal and no
    answer has printed yet, as a status line that the next one replaces and the first answer
    clears (a first run's measuring is not silent, and leaves nothing behind)."""

    def __init__(self, verbose: bool = False):
        self.verbose = verbose
        self._status = False  # a status line is on the terminal
        self._answering = False

    def __call__(self, message: str) -> None:
        if self.verbose:
            log(message)
        elif not self._answering and sys.stderr.isatty():
            width = max(shutil.get_terminal_size().columns - 1, 20)
            sys.stderr.write("\r\x1b[K" + (message.splitlines() or [""])[0][:width])
            sys.stderr.flush()
            self._status = True

    def answering(self) -> None:
        """Output for the person follows: clear the status line (diagnostics without
        ``verbose`` are dropped from now on)."""
        if self._status:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self._status = False
        self._answering = True

    def show(self, line: str) -> None:
        self.answering()
        log(line)


@dataclasses.dataclass
class Tally:
    """One decoder's totals over every answer, for the summary line: tokens and the seconds
    they took (compilation excluded), EAGLE's verification rounds and the tokens those rounds
    emitted (tau: their ratio), answers that gave up drafting somewhere."""

    tokens: int = 0
    seconds: float = 0.0
    answers: int = 0
    rounds: int = 0
    round_tokens: int = 0
    fell_back: int = 0

    def add(self, gens: Sequence[Generation], seconds: float) -> None:
        """One batched call: its generations and its wall time."""
        self.tokens += sum(len(g.token_ids) for g in gens)
        self.seconds += seconds
        for g in gens:
            self.answers += 1
            if g.rounds is not None:
                self.rounds += g.rounds
                self.round_tokens += sum(j * n for j, n in enumerate(g.accept_hist))
                self.fell_back += g.plain_steps > 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tau(self) -> float | None:
        return self.round_tokens / self.rounds if self.rounds else None


def summary_line(mode: str, main: Tally, *, drafting: bool, plain: Tally | None = None,
                 identical: int | None = None) -> str:
    """The run in one line: ``mode`` (which decoder, and for EAGLE its tree), tau where it
    drafted (``drafting``), tokens/s; with ``plain`` (``--compare``) plain decoding's tokens/s,
    the speed-up and whether the outputs are identical (``identical`` of ``main.answers``); the
    answers that gave up drafting where it did not pay, if any. E.g.::

        eagle (tree: top-k 2, depth 4, 6 tokens, chosen for this machine): tau 1.74,
        52.3 tokens/s; plain 30.9 tokens/s, speed-up 1.69x, outputs identical
    """
    stats = []
    if drafting:
        stats.append("tau -" if main.tau is None else f"tau {main.tau:.2f}")
    stats.append(f"{main.tokens_per_s:.1f} tokens/s")
    line = f"{mode}: {', '.join(stats)}"
    if plain is not None:
        same = ("outputs identical" if identical == main.answers
                else f"outputs identical on {identical}/{main.answers} answers")
        line += (f"; plain {plain.tokens_per_s:.1f} tokens/s, speed-up "
                 f"{main.tokens_per_s / max(plain.tokens_per_s, 1e-9):.2f}x, {same}")
    if main.fell_back:
        line += (f"; gave up drafting where it did not pay on {main.fell_back}/{main.answers} "
                 "answers")
    return line


class Answers:
    """Turns generated ids into the text and JSON record of an answer (stop strings applied)."""

    def __init__(self, tokenizer: Any, max_new_tokens: int, stop: tuple[str, ...] = ()):
        self.tokenizer, self.max_new_tokens, self.stop = tokenizer, max_new_tokens, stop

    def incremental(self) -> IncrementalText:
        return IncrementalText(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                               self.stop)

    def cut(self, gen: Generation) -> tuple[list[int], str, bool]:
        """(token ids up to and including the one that completed a stop string, the text before
        it, whether a stop string ended the answer)."""
        text = self.incremental()
        for token in gen.token_ids:
            text.push(token)
            if text.stopped:
                break
        return text.token_ids, text.text, text.stopped

    def text(self, gen: Generation) -> str:
        return self.cut(gen)[1]

    def record(self, gen: Generation) -> dict:
        ids, text, stopped = self.cut(gen)
        if stopped:
            stop = "stop"
        elif gen.hit_eos:
            stop = "eos"
        else:
            stop = "length" if len(gen.token_ids) >= self.max_new_tokens else "context"
        return {"token_ids": ids, "text": text, "new_tokens": len(ids), "stop": stop,
                "seconds": round(gen.seconds, 4),
                "tokens_per_s": round(len(gen.token_ids) / max(gen.seconds, 1e-9), 2),
                **({"reused_prompt_tokens": gen.reused} if gen.reused else {}),
                **gen.eagle_fields()}


def run_json(conversations, fmt: PromptFormat, decoder, batch_size: int, answers: Answers,
             console: Console) -> Tally:
    """One JSON object per line per turn (see :mod:`eagle3_jax.decode`); returns the totals."""
    tally = Tally()

    def emit(i, turn, prompt, gen, rows):
        record = {"index": i, "turn": turn, "prompt_token_ids": prompt, **answers.record(gen),
                  "batch_size": rows}
        console.answering()
        print(json.dumps(record, ensure_ascii=False), flush=True)

    def generate(prompts, before, keep):
        gens = decoder.generate_batch(prompts, [g.prefix if g else None for g in before],
                                      keep=keep)
        tally.add(gens, gens[0].seconds)  # one batched call
        return gens

    decode_turns(conversations, fmt, batch_size, generate, answers.text, emit)
    return tally


def run_compare(conversations, fmt: PromptFormat, decoders: dict, batch_size: int,
                answers: Answers, as_json: bool,
                console: Console) -> tuple[Tally, Tally, int]:
    """Both modes on the same prompts (the history takes EAGLE's answer); returns (EAGLE's
    totals, plain decoding's, identical answers). With ``console.verbose`` a line per turn and
    the totals line: tokens/s of each (tokens / seconds over all batches), speed-up,
    identical."""
    totals = {name: Tally() for name in ("vanilla", "eagle")}
    rounds, turns, identical, hist, fell_back, resumed = 0, 0, 0, [], 0, 0
    echo = console.verbose or sum(map(len, conversations)) > 1

    def generate(prompts, before, keep):
        pairs = {}
        for j, name in enumerate(("vanilla", "eagle")):  # each starts from its own caches
            prefixes = [pair[j].prefix if pair else None for pair in before]
            gens = decoders[name].generate_batch(prompts, prefixes, keep=keep)
            totals[name].add(gens, gens[0].seconds)  # one batched call
            pairs[name] = gens
        return list(zip(pairs["vanilla"], pairs["eagle"]))

    def emit(i, turn, prompt, pair, rows):
        nonlocal rounds, turns, identical, hist, fell_back, resumed
        plain, spec = pair
        same = plain.token_ids == spec.token_ids
        rounds, turns, identical = rounds + spec.rounds, turns + 1, identical + same
        fell_back += spec.plain_steps > 0
        resumed += spec.resumes > 0
        hist = [a + b for a, b in zip(hist or [0] * len(spec.accept_hist), spec.accept_hist)]
        eagle_record, plain_record = answers.record(spec), answers.record(plain)
        if as_json:
            record = {"index": i, "turn": turn, "prompt_token_ids": prompt, **eagle_record,
                      "batch_size": rows, "identical": same,
                      "speedup": round(eagle_record["tokens_per_s"]
                                       / max(plain_record["tokens_per_s"], 1e-9), 3),
                      "vanilla": plain_record}
            console.answering()
            print(json.dumps(record, ensure_ascii=False), flush=True)
        else:
            if echo:
                console.show(f"> {conversations[i][turn]}")
            console.answering()
            print(eagle_record["text"], flush=True)
            console(f"[prompt {i} turn {turn}: vanilla {plain_record['tokens_per_s']:.1f} "
                    f"tokens/s, eagle {eagle_record['tokens_per_s']:.1f} tokens/s, mean accept "
                    f"length {eagle_record['mean_accept_length']:.2f}, identical: "
                    f"{'yes' if same else 'NO'}]")

    decode_turns(conversations, fmt, batch_size, generate, lambda pair: answers.text(pair[1]),
                 emit)
    if console.verbose:
        speed = {name: t.tokens_per_s for name, t in totals.items()}
        summary = (f"compare: vanilla {speed['vanilla']:.1f} tokens/s, eagle "
                   f"{speed['eagle']:.1f} tokens/s, speed-up "
                   f"{speed['eagle'] / max(speed['vanilla'], 1e-9):.2f}x; mean accept length "
                   f"{mean_accept_length(hist):.2f} over {rounds} rounds; identical texts "
                   f"{identical}/{turns}")
        if fell_back:
            summary += (f"; gave up drafting on {fell_back}/{turns} turns (it did not pay "
                        f"there) and decoded plainly until the draft's hits said it would pay "
                        f"again ({resumed} of them resumed)")
        if as_json:
            log(summary)  # stdout stays one JSON object per turn
        else:
            print(summary, flush=True)
    return totals["eagle"], totals["vanilla"], identical


def stream_answer(decoder, prompt: list[int], answers: Answers, out: TextIO | None = None,
                  prefix=None, console: Console | None = None,
                  tally: Tally | None = None) -> str:
    """Print one answer as it is generated (to ``out``, default stdout), from the turn
    before's caches (``prefix``, ``decoder.stream_prefix()``) when given; its timings go to
    ``console`` (printed with ``verbose``, the default without one) and ``tally``; return its
    text."""
    out = out or sys.stdout
    console = console or Console(verbose=True)
    text = answers.incremental()
    start = time.perf_counter()
    # The first token comes with the prefill, the second after the step's compilation (first
    # use only): the rate is measured from the second step on.
    first_at = second_at = None
    steps = tokens = round_tokens = 0
    for step_tokens in decoder.stream(prompt, prefix):
        steps += 1
        if steps == 1:
            first_at = time.perf_counter()
            console.answering()
        elif steps == 2:
            second_at = time.perf_counter()
        for token in step_tokens:
            out.write(text.push(token))
            if text.stopped:
                break
            tokens += 1
            round_tokens += steps > 1
        out.flush()
        if text.stopped:
            break
    console.answering()
    out.write(text.flush() + "\n")
    out.flush()
    end = time.perf_counter()
    timed = second_at is not None and tokens > 1 and end > second_at
    rate = (tokens - 1) / (end - second_at) if timed else 0.0
    extra = ""
    rounds = plain = None
    if decoder.counts_rounds and steps > 1:
        # Steps after a fallback (the decoder gave up drafting) are plain: one token each.
        rounds, plain = decoder.stream_rounds, decoder.stream_plain_steps
        extra = (f"; {rounds} rounds, mean accept length "
                 f"{(round_tokens - plain) / max(rounds, 1):.2f}")
        if plain:
            resumed = decoder.stream_resumes
            extra += (f"; and {plain} plain decode steps where drafting did not pay (it "
                      f"accepted too little for the cost of a round here"
                      + (f"; it resumed {resumed} time{'s' * (resumed > 1)})" if resumed
                         else ")"))
    if tally is not None:
        tally.answers += 1
        if timed:
            tally.tokens += tokens - 1
            tally.seconds += end - second_at
        if rounds is not None:
            tally.rounds += rounds
            tally.round_tokens += round_tokens - plain
            tally.fell_back += plain > 0
    reused = (f", {decoder.stream_reused[0]} of {len(prompt)} prompt tokens from the turn before"
              if decoder.stream_reused[0] else "")
    console(f"[{tokens} tokens in {end - start:.2f} s; first token after "
            f"{(first_at or end) - start:.2f} s (prefill{reused}, compilation on first use); "
            f"decoding {rate:.1f} tokens/s{extra}]")
    return text.text


def run_stream(conversations, fmt: PromptFormat, decoder, answers: Answers,
               console: Console) -> Tally:
    """Each conversation turn by turn, one prompt at a time, answers streamed (each after its
    prompt's echo where there are several, or with ``console.verbose``); returns the totals."""
    tally = Tally()
    echo = console.verbose or sum(map(len, conversations)) > 1
    for index, turns in enumerate(conversations):
        history, prefix = fmt.new_history(), None
        for turn, user in enumerate(turns):
            history.append({"role": "user", "content": user})
            prompt = fmt.prompt_ids(history, f"prompt {index} (turn {turn})")
            if echo:
                console.show(f"> {user}")
            history.append({"role": "assistant", "content": stream_answer(
                decoder, prompt, answers, prefix=prefix, console=console, tally=tally)})
            prefix = decoder.stream_prefix() if turn + 1 < len(turns) else None
    return tally


def run_chat(fmt: PromptFormat, decoder, answers: Answers, console: Console,
             read_line: Callable[[], str] | None = None) -> Tally:
    """Interactive multi-turn chat: read a message, stream the answer, keep the history; an
    empty line is skipped, end of input (Ctrl-D) leaves. Returns the totals."""
    read_line = read_line or sys.stdin.readline
    history, prefix = fmt.new_history(), None
    tally = Tally()
    console.show("[chat: type a message and press Enter; Ctrl-D leaves]")
    turn = 0
    while True:
        sys.stderr.write("> ")
        sys.stderr.flush()
        line = read_line()
        if not line:  # end of input
            log("")
            return tally
        message = line.rstrip("\n")
        if not message.strip():
            continue
        history.append({"role": "user", "content": message})
        try:
            prompt = fmt.prompt_ids(history, f"turn {turn}")
        except UsageError as e:  # too long for the context: say so, keep chatting
            history.pop()
            log(f"error: {e}")
            continue
        history.append({"role": "assistant", "content": stream_answer(
            decoder, prompt, answers, prefix=prefix, console=console, tally=tally)})
        prefix = decoder.stream_prefix()  # the next turn starts from this one's caches
        turn += 1
