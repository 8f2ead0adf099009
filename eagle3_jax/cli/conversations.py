"""Prompts in, token ids out: conversations from flags or JSONL, decoded turn by turn.

A conversation is the list of its user turns. Turn k is asked with the earlier turns and their
generated answers as history (after an optional system prompt), through the target's chat
template; with ``raw`` the text is tokenized as it is, no template (one turn only).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Sequence

from eagle3_jax.errors import UsageError

EXAMPLE_PROMPT = "What are three good reasons to learn a second language? Answer briefly."


def read_conversations(prompt: str | None, prompts_file: str | None) -> list[list[str]]:
    """The user turns of every conversation (a single prompt is one 1-turn list)."""
    if prompt is not None:
        return [[prompt]]
    if prompts_file is None:
        return [[EXAMPLE_PROMPT]]
    path = Path(prompts_file)
    if not path.is_file():
        raise UsageError(f"--prompts-file {str(path)!r} does not exist")
    conversations = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                conversations.append(_parse_line(line, number, path))
    if not conversations:
        raise UsageError(f"--prompts-file {str(path)!r} has no prompts")
    return conversations


def _parse_line(line: str, number: int, path: Path) -> list[str]:
    where = f"{path}:{number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: line {number} is not valid JSON ({e.msg})") from None
    if isinstance(item, dict) and isinstance(item.get("prompt"), str):
        return [item["prompt"]]
    turns = item.get("turns") if isinstance(item, dict) else None
    if isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns):
        return list(turns)
    raise UsageError(f'{where}: line {number} must be {{"prompt": str}} or '
                     '{"turns": [str, ...]}')


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How a turn becomes token ids: the chat template with an optional system prompt, or the
    raw text (``raw``: no template, no history)."""

    tokenizer: Any
    context: int  # the model's context length
    system: str | None = None
    raw: bool = False

    def new_history(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def prompt_ids(self, history: list[dict[str, str]], where: str) -> list[int]:
        """Token ids of the conversation so far (ending with a user turn), checked to fit."""
        if self.raw:
            ids = self.tokenizer.encode(history[-1]["content"])
        else:
            ids = self.tokenizer.apply_chat_template(history, add_generation_prompt=True)
        if len(ids) > self.context:
            raise UsageError(f"{where} is {len(ids)} tokens but the model context is "
                             f"{self.context}; shorten the prompt or drop earlier turns")
        return ids


def decode_turns(conversations: list[list[str]], fmt: PromptFormat, batch_size: int,
                 generate: Callable[[list[list[int]], list[Any], bool], list[Any]],
                 answer_text: Callable[[Any], str], emit: Callable) -> None:
    """Batches of conversations, turn by turn; turn k's prompt holds the earlier answers.

    ``generate(prompts, before, keep) -> results``: ``before[j]`` is prompt j's result of the
    turn before (None on a first turn), whose kept caches a decoder may start from
    (``Generation.prefix``); ``keep``: some row has a later turn, so keep this turn's caches.
    ``answer_text(result)`` is what enters the history; ``emit(index, turn, prompt_ids, result,
    rows_in_batch)`` reports one turn.
    """
    for first in range(0, len(conversations), batch_size):
        group = list(range(first, min(first + batch_size, len(conversations))))
        histories = {i: fmt.new_history() for i in group}
        last: dict[int, Any] = {}
        for turn in range(max(len(conversations[i]) for i in group)):
            rows = [i for i in group if turn < len(conversations[i])]
            prompts = []
            for i in rows:
                histories[i].append({"role": "user", "content": conversations[i][turn]})
                prompts.append(fmt.prompt_ids(histories[i], f"prompt {i} (turn {turn})"))
            keep = any(turn + 1 < len(conversations[i]) for i in rows)
            results = generate(prompts, [last.get(i) for i in rows], keep)
            for i, prompt, result in zip(rows, prompts, results):
                histories[i].append({"role": "assistant", "content": answer_text(result)})
                emit(i, turn, prompt, result, len(rows))
                last[i] = result


def check_raw(raw: bool, conversations: Sequence[Sequence[str]], system: str | None,
              chat: bool) -> None:
    """``--raw`` has no template, so no system prompt and no multi-turn history."""
    if not raw:
        return
    if system is not None or chat:
        raise UsageError("--raw feeds the text without a chat template, so it cannot take "
                         f"{'--system' if system is not None else '--chat'}; drop one of them")
    if any(len(turns) > 1 for turns in conversations):
        raise UsageError("--raw takes single-turn prompts; a --prompts-file line has several "
                         "turns (drop --raw to use the chat template)")
