"""What the decoder CLI prints: streamed text, JSON lines, a plain-vs-EAGLE compare, a chat.

Streamed text goes to stdout as it is generated; prompt echoes and timings go to stderr. Every
report of acceptance uses one definition: new tokens / verification rounds, where the prefill's
first token is not a round and nothing after an EOS, a stop string or the token limit counts.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, TextIO

from eagle3_jax.cli.conversations import PromptFormat, decode_turns
from eagle3_jax.decoding.acceptance import mean_accept_length
from eagle3_jax.decoding.decoders import Generation
from eagle3_jax.errors import UsageError
from eagle3_jax.text.incremental import IncrementalText


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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


def run_json(conversations, fmt: PromptFormat, decoder, batch_size: int,
             answers: Answers) -> None:
    """One JSON object per line per turn (see :mod:`eagle3_jax.decode`)."""
    def emit(i, turn, prompt, gen, rows):
        record = {"index": i, "turn": turn, "prompt_token_ids": prompt, **answers.record(gen),
                  "batch_size": rows}
        print(json.dumps(record, ensure_ascii=False), flush=True)

    def generate(prompts, before, keep):
        return decoder.generate_batch(prompts, [g.prefix if g else None for g in before], keep=keep)

    decode_turns(conversations, fmt, batch_size, generate, answers.text, emit)


def run_compare(conversations, fmt: PromptFormat, decoders: dict, batch_size: int,
                answers: Answers, as_json: bool) -> None:
    """Both modes on the same prompts (the history takes EAGLE's answer); per turn a line, then
    the totals: tokens/s of each (tokens / seconds over all batches), speed-up, identical."""
    totals = {name: {"tokens": 0, "seconds": 0.0} for name in ("vanilla", "eagle")}
    rounds, turns, identical, hist, fell_back, resumed = 0, 0, 0, [], 0, 0

    def generate(prompts, before, keep):
        pairs = {}
        for j, name in enumerate(("vanilla", "eagle")):  # each starts from its own caches
            prefixes = [pair[j].prefix if pair else None for pair in before]
            gens = decoders[name].generate_batch(prompts, prefixes, keep=keep)
            totals[name]["tokens"] += sum(len(g.token_ids) for g in gens)
            totals[name]["seconds"] += gens[0].seconds  # one batched call
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
            print(json.dumps(record, ensure_ascii=False), flush=True)
        else:
            log(f"> {conversations[i][turn]}")
            print(eagle_record["text"], flush=True)
            log(f"[prompt {i} turn {turn}: vanilla {plain_record['tokens_per_s']:.1f} tokens/s, "
                f"eagle {eagle_record['tokens_per_s']:.1f} tokens/s, mean accept length "
                f"{eagle_record['mean_accept_length']:.2f}, identical: {'yes' if same else 'NO'}]")

    decode_turns(conversations, fmt, batch_size, generate, lambda pair: answers.text(pair[1]),
                 emit)
    speed = {name: t["tokens"] / max(t["seconds"], 1e-9) for name, t in totals.items()}
    summary = (f"compare: vanilla {speed['vanilla']:.1f} tokens/s, eagle {speed['eagle']:.1f} "
               f"tokens/s, speed-up {speed['eagle'] / max(speed['vanilla'], 1e-9):.2f}x; "
               f"mean accept length {mean_accept_length(hist):.2f} over {rounds} rounds; "
               f"identical texts {identical}/{turns}")
    if fell_back:
        summary += (f"; gave up drafting on {fell_back}/{turns} turns (it did not pay there) "
                    f"and decoded plainly until the draft's hits said it would pay again "
                    f"({resumed} of them resumed)")
    if as_json:
        log(summary)  # stdout stays one JSON object per turn
    else:
        print(summary, flush=True)


def stream_answer(decoder, prompt: list[int], answers: Answers, out: TextIO | None = None,
                  prefix=None) -> str:
    """Print one answer as it is generated (to ``out``, default stdout), from the turn
    before's caches (``prefix``, ``decoder.stream_prefix()``) when given; log its timings;
    return its text."""
    out = out or sys.stdout
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
    out.write(text.flush() + "\n")
    out.flush()
    end = time.perf_counter()
    rate = ((tokens - 1) / (end - second_at) if second_at and tokens > 1 and end > second_at
            else 0.0)
    extra = ""
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
    reused = (f", {decoder.stream_reused[0]} of {len(prompt)} prompt tokens from the turn before"
              if decoder.stream_reused[0] else "")
    log(f"[{tokens} tokens in {end - start:.2f} s; first token after "
        f"{(first_at or end) - start:.2f} s (prefill{reused}, compilation on first use); "
        f"decoding {rate:.1f} tokens/s{extra}]")
    return text.text


def run_stream(conversations, fmt: PromptFormat, decoder, answers: Answers) -> None:
    """Each conversation turn by turn, one prompt at a time, answers streamed."""
    for index, turns in enumerate(conversations):
        history, prefix = fmt.new_history(), None
        for turn, user in enumerate(turns):
            history.append({"role": "user", "content": user})
            prompt = fmt.prompt_ids(history, f"prompt {index} (turn {turn})")
            log(f"> {user}")
            history.append({"role": "assistant",
                            "content": stream_answer(decoder, prompt, answers, prefix=prefix)})
            prefix = decoder.stream_prefix() if turn + 1 < len(turns) else None


def run_chat(fmt: PromptFormat, decoder, answers: Answers,
             read_line: Callable[[], str] | None = None) -> None:
    """Interactive multi-turn chat: read a message, stream the answer, keep the history; an
    empty line is skipped, end of input (Ctrl-D) leaves."""
    read_line = read_line or sys.stdin.readline
    history, prefix = fmt.new_history(), None
    log("[chat: type a message and press Enter; Ctrl-D leaves]")
    turn = 0
    while True:
        sys.stderr.write("> ")
        sys.stderr.flush()
        line = read_line()
        if not line:  # end of input
            log("")
            return
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
        history.append({"role": "assistant",
                        "content": stream_answer(decoder, prompt, answers, prefix=prefix)})
        prefix = decoder.stream_prefix()  # the next turn starts from this one's caches
        turn += 1
