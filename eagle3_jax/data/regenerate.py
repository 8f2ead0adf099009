"""Replace the assistant turns of prepared conversations with the target's own answers.

EAGLE trains the draft on what the *target* says, not on what ShareGPT's ChatGPT said: for each
conversation, every assistant turn is regenerated from the conversation so far (the user turns
as given, the earlier assistant turns as regenerated), rendered by the target's chat template
with the generation prompt. Greedy by default, or sampled.

Batching: ``batch_size`` rows decode together and a row that finishes is refilled at once
with the next prompt (:class:`~eagle3_jax.decoding.continuous.ContinuousDecoder`), so no row
idles while the longest answer of a batch finishes. A conversation's next turn (its prompt holds
the answer just generated) goes to the front of the queue, so conversations finish, and are
written, one after another rather than all at the end. Each answer equals plain greedy decoding
of its prompt alone.

Long prompts: a turn whose prompt exceeds ``max_prompt_len`` tokens is *not* cut from the left
(that would drop the system prompt and the template's opening, showing the target a prompt it
never sees in use). Instead the conversation ends before that turn: the turns already
regenerated are kept, and a conversation with none is skipped (listed in ``skipped.jsonl`` with
the reason, so a resumed run does not try it again).

Output (``out_dir``)::

    regenerated-00000.jsonl ...  one {id, conversations, regenerated_by} per line, appended and
                                 flushed as each conversation completes (in finishing order;
                                 ``shard_size`` lines a file)
    skipped.jsonl                {id, reason} of conversations left out
    conversations.jsonl          when every requested conversation is done: all shards merged
                                 in input order, so ``vocab --data OUT_DIR`` reads it unchanged

Resuming: ids already in a shard (or in ``skipped.jsonl``) are not regenerated again. A last
line cut off by an interruption (no trailing newline) is truncated away and that conversation
is done again. With sampling, the random stream depends on the batch order, so a resumed run
samples different (equally valid) answers than an uninterrupted one would have.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from eagle3_jax.data.sources import CONVERSATIONS_FILE, DataError, read_conversations, write_jsonl

SHARD_PATTERN = "regenerated-{:05d}.jsonl"
SHARD_GLOB = "regenerated-*.jsonl"
SKIPPED_FILE = "skipped.jsonl"
DEFAULT_MAX_PROMPT_LEN = 2048


@dataclasses.dataclass
class RegenerateStats:
    """What one :func:`regenerate_conversations` call did."""

    requested: int = 0        # conversations asked for (after --limit)
    already_done: int = 0     # found in the output (or skipped.jsonl) and left alone
    regenerated: int = 0      # conversations written by this call
    skipped: int = 0          # conversations left out by this call (first prompt too long)
    answers: int = 0          # assistant turns generated
    new_tokens: int = 0       # tokens generated (EOS not counted)
    cut_at_max_tokens: int = 0  # answers that reached max_new_tokens without an EOS
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        return (f"{self.regenerated} conversations regenerated ({self.answers} answers, "
                f"{self.new_tokens} tokens, {self.cut_at_max_tokens} cut at max_new_tokens), "
                f"{self.already_done} already done, {self.skipped} skipped, in "
                f"{self.seconds:.1f} s ({self.tokens_per_second:.1f} tokens/s)")


# -- the output folder --------------------------------------------------------------------------

def _read_lines_repairing(path: Path) -> list[dict]:
    """Records of a JSONL file we append to; a cut-off last line is truncated from the file."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):  # an interrupted write: drop the partial line for good
        with open(path, "r+b") as f:
            f.truncate(end)
    out = []
    for lineno, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record["id"]  # noqa: B018 - every line must name its conversation
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DataError(f"{path}: line {lineno} is malformed ({e}); fix or delete the file "
                            "to regenerate its conversations") from None
        out.append(record)
    return out


@dataclasses.dataclass
class _OutputState:
    done: dict[str, Path]         # id -> shard it is in
    skipped: set[str]
    last_shard: int               # index of the last shard (-1: none yet)
    last_shard_lines: int


def scan_output(out_dir: Path) -> _OutputState:
    """What an earlier (possibly interrupted) run left in ``out_dir``."""
    done: dict[str, Path] = {}
    last, last_lines = -1, 0
    for shard in sorted(out_dir.glob(SHARD_GLOB)):
        try:
            index = int(shard.stem.rsplit("-", 1)[1])
        except ValueError:
            continue  # not ours
        records = _read_lines_repairing(shard)
        for r in records:
            done[str(r["id"])] = shard
        if index > last:
            last, last_lines = index, len(records)
    skipped = set()
    if (out_dir / SKIPPED_FILE).is_file():
        skipped = {str(r["id"]) for r in _read_lines_repairing(out_dir / SKIPPED_FILE)}
    return _OutputState(done, skipped, last, last_lines)


class _Appender:
    """Appends records to ``regenerated-NNNNN.jsonl`` shards, ``shard_size`` lines each."""

    def __init__(self, out_dir: Path, state: _OutputState, shard_size: int):
        self.out_dir, self.shard_size = out_dir, shard_size
        self.index, self.lines = state.last_shard, state.last_shard_lines
        if self.index < 0 or self.lines >= shard_size:
            self.index, self.lines = self.index + 1, 0
        self.file = None

    def write(self, records: Iterable[Mapping]) -> None:
        for record in records:
            if self.lines >= self.shard_size:
                self.close()
                self.index, self.lines = self.index + 1, 0
            if self.file is None:
                path = self.out_dir / SHARD_PATTERN.format(self.index)
                self.file = open(path, "a", encoding="utf-8")
            self.file.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.lines += 1
        if self.file is not None:  # a batch is durable once written: resume skips it
            self.file.flush()
            os.fsync(self.file.fileno())

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _append_skipped(out_dir: Path, items: Sequence[tuple[str, str]]) -> None:
    if not items:
        return
    with open(out_dir / SKIPPED_FILE, "a", encoding="utf-8") as f:
        for cid, reason in items:
            f.write(json.dumps({"id": cid, "reason": reason}) + "\n")


def merge_shards(out_dir: str | Path, order: Sequence[str] = ()) -> Path:
    """Write every shard's records to ``out_dir/conversations.jsonl`` (ids in ``order`` first,
    in that order, then the rest), atomically. Returns the path."""
    out_dir = Path(out_dir)
    records: dict[str, dict] = {}
    for shard in sorted(out_dir.glob(SHARD_GLOB)):
        for r in _read_lines_repairing(shard):
            records[str(r["id"])] = r
    rank = {cid: i for i, cid in enumerate(order)}
    ordered = sorted(records.values(), key=lambda r: rank.get(str(r["id"]), len(rank)))
    return write_jsonl(ordered, out_dir / CONVERSATIONS_FILE)


# -- one conversation ---------------------------------------------------------------------------

@dataclasses.dataclass
class _Conversation:
    id: str
    messages: list[dict]          # what is written: system?, then user/assistant(regenerated)
    users: list[str]              # the user turns still to answer, in order
    stopped: str | None = None    # why regeneration ended early (prompt too long)


def _plan(conv: Mapping, cid: str, max_turns: int | None) -> _Conversation:
    """Split a normalised conversation into its system message and the user turns to answer
    (those followed by an assistant turn; at most ``max_turns``)."""
    messages = list(conv["conversations"])
    system = [dict(m) for m in messages[:1] if m["role"] == "system"]
    users = [m["content"] for m, nxt in zip(messages, messages[1:])
             if m["role"] == "user" and nxt["role"] == "assistant"]
    if max_turns is not None:
        users = users[:max_turns]
    return _Conversation(cid, system, users)


def _opening_length(c: _Conversation) -> int:
    """Characters of a conversation's system message and first user turn: the order prompts
    are fed in (shortest first), and what ``shortest`` selects by."""
    return sum(len(m["content"]) for m in c.messages) + len(c.users[0] if c.users else "")


def _conversation_ids(conversations: Sequence[Mapping]) -> list[str]:
    ids = [str(c.get("id", f"#{i}")) for i, c in enumerate(conversations)]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DataError(f"conversation id {dup!r} appears more than once; ids must be unique "
                        "to resume (`prepare` makes them unique)")
    return ids


# -- the whole job ------------------------------------------------------------------------------

def regenerate_conversations(
    conversations: Sequence[Mapping],
    target: Any,
    out_dir: str | Path,
    *,
    batch_size: int = 8,
    max_new_tokens: int = 512,
    max_turns: int | None = None,
    max_prompt_len: int | None = None,
    sampling: Any = None,
    seed: int = 0,
    shard_size: int = 10000,
    progress: bool = False,
    shortest: int | None = None,
) -> RegenerateStats:
    """Regenerate the assistant turns of ``conversations`` with ``target`` into ``out_dir``.

    Args:
      conversations: normalised ``{id, conversations: [{role, content}]}`` records.
      target: a :class:`~eagle3_jax.checkpoints.LoadedTarget` (cfg, params, tokenizer, source).
      batch_size: conversations generated together.
      max_new_tokens: longest answer, in tokens; generation also stops at an EOS id.
      max_turns: answer only the first N user turns (None: all).
      max_prompt_len: longest prompt in tokens (see the module doc); default
        min(2048, context - max_new_tokens).
      sampling: a :class:`~eagle3_jax.decoding.SamplingParams`; None is greedy.
      seed: PRNG seed when sampling.
      shard_size: lines per output shard.
      shortest: answer only the ``shortest`` conversations with the shortest openings (system
        message + first user turn, in characters; ties in input order): a set that does not
        depend on what an earlier, interrupted run finished. None: all.
    Returns:
      :class:`RegenerateStats`; also merges the shards into ``conversations.jsonl`` when every
      requested conversation is done.
    """
    import jax

    from eagle3_jax.decoding import GREEDY
    from eagle3_jax.decoding.continuous import ContinuousDecoder

    sampling = GREEDY if sampling is None else sampling
    cfg, tok = target.cfg, target.tokenizer
    context = cfg.max_position_embeddings
    if batch_size < 1 or max_new_tokens < 1 or shard_size < 1:
        raise DataError(f"batch_size ({batch_size}), max_new_tokens ({max_new_tokens}) and "
                        f"shard_size ({shard_size}) must be positive")
    if max_turns is not None and max_turns < 1:
        raise DataError(f"max_turns must be >= 1, got {max_turns}")
    if max_prompt_len is None:
        max_prompt_len = min(DEFAULT_MAX_PROMPT_LEN, context - max_new_tokens)
    if max_prompt_len < 1 or max_prompt_len + max_new_tokens > context:
        raise DataError(f"max_prompt_len ({max_prompt_len}) + max_new_tokens ({max_new_tokens}) "
                        f"must fit the target's context of {context} tokens")
    if tok is None:
        raise DataError("regenerating needs the target's tokenizer (its chat template)")

    if shortest is not None:
        if shortest < 1:
            raise DataError(f"shortest must be >= 1, got {shortest}")
        lengths = [_opening_length(_plan(c, "", max_turns)) for c in conversations]
        keep = sorted(sorted(range(len(conversations)), key=lambda i: lengths[i])[:shortest])
        conversations = [conversations[i] for i in keep]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = _conversation_ids(conversations)
    state = scan_output(out_dir)
    stats = RegenerateStats(requested=len(conversations))
    pending = [(cid, c) for cid, c in zip(ids, conversations)
               if cid not in state.done and cid not in state.skipped]
    stats.already_done = len(conversations) - len(pending)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(conversations), initial=stats.already_done, desc="regenerating",
                   unit=" conv", dynamic_ncols=True)
    appender = _Appender(out_dir, state, shard_size)
    decoder = ContinuousDecoder(target.params, cfg, slots=batch_size,
                                max_new_tokens=max_new_tokens, max_prompt_len=max_prompt_len,
                                sampling=sampling, eos_token_ids=tok.eos_token_ids,
                                pad_id=tok.pad_token_id)

    def next_prompt(c: _Conversation):
        """The prompt of ``c``'s next turn, or None when ``c`` is finished (written out)."""
        turn = sum(m["role"] == "assistant" for m in c.messages)
        if turn < len(c.users):
            c.messages.append({"role": "user", "content": c.users[turn]})
            prompt = tok.apply_chat_template(c.messages, add_generation_prompt=True)
            if len(prompt) <= max_prompt_len:
                return prompt
            c.messages.pop()
            c.stopped = f"turn {turn + 1} prompt has {len(prompt)} tokens > max_prompt_len " \
                        f"{max_prompt_len}"
        if turn:
            appender.write([{"id": c.id, "conversations": c.messages,
                             "regenerated_by": target.source}])
            stats.regenerated += 1
        else:
            _append_skipped(out_dir, [(c.id, c.stopped or "no user turn to answer")])
            stats.skipped += 1
        if bar is not None:
            stats.seconds = time.perf_counter() - start
            bar.set_postfix_str(f"{stats.tokens_per_second:.1f} tok/s", refresh=False)
            bar.update(1)
        return None

    def top_up(queue: collections.deque, conversations_left) -> None:
        """Queue first turns until ``batch_size`` prompts wait (or no conversation is left)."""
        while len(queue) < batch_size:
            c = next(conversations_left, None)
            if c is None:
                return
            prompt = next_prompt(c)
            if prompt is not None:
                queue.append((c, prompt))

    start = time.perf_counter()
    try:
        # Shortest first prompts first: the decoder's cache grows only as prompts get longer.
        plans = sorted((_plan(c, cid, max_turns) for cid, c in pending), key=_opening_length)
        conversations_left = iter(plans)
        queue: collections.deque = collections.deque()
        # Keep a few prompts queued ahead; a conversation's next turn goes to the front, so it
        # finishes (and is written) soon after its first answer.
        top_up(queue, conversations_left)
        for finished in decoder.run(queue, jax.random.PRNGKey(seed)):
            c = finished.job
            c.messages.append({"role": "assistant", "content": tok.decode(finished.tokens)})
            stats.answers += 1
            stats.new_tokens += len(finished.tokens)
            stats.cut_at_max_tokens += int(not finished.hit_eos)
            prompt = next_prompt(c)
            if prompt is not None:
                queue.appendleft((c, prompt))
            top_up(queue, conversations_left)
    finally:
        appender.close()
        if bar is not None:
            bar.close()
        stats.seconds = time.perf_counter() - start
    merge_shards(out_dir, ids)
    return stats


def regenerate(
    data: str | Path,
    out_dir: str | Path,
    target: Any,
    *,
    limit: int | None = None,
    **kwargs: Any,
) -> RegenerateStats:
    """Read conversations from ``data`` (a ``prepare`` folder or ``.jsonl``), take the first
    ``limit``, and :func:`regenerate_conversations` them with ``target`` (a LoadedTarget, or a
    preset name / path given to :func:`~eagle3_jax.checkpoints.load_target`)."""
    conversations = load_conversations(data, limit)
    if isinstance(target, (str, Path)) or target is None:
        target = load_target_or_error(target)
    return regenerate_conversations(conversations, target, out_dir, **kwargs)


def load_conversations(data: str | Path, limit: int | None = None) -> list[dict]:
    """The first ``limit`` conversations of a ``prepare`` folder or ``.jsonl``."""
    if limit is not None and limit < 1:
        raise DataError(f"--limit must be >= 1, got {limit}")
    return read_conversations(data)[:limit]


def load_target_or_error(target: str | Path | None, **kwargs: Any):
    """:func:`~eagle3_jax.checkpoints.load_target`, its errors as one-line DataErrors."""
    from eagle3_jax.checkpoints import CheckpointError, load_target
    from eagle3_jax.presets import PresetError

    try:
        return load_target(target, **kwargs)
    except (CheckpointError, PresetError) as e:
        raise DataError(str(e).splitlines()[0]) from None
