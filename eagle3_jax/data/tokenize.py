"""Conversations -> token ids with the target's own chat template and an assistant loss mask.

The mask covers what the draft must learn to predict: each assistant message's content and the
template's end-of-turn token after it (``<|im_end|>``, ``<|eot_id|>``), but not the assistant
header (``<|im_start|>assistant\\n``), nor system/user turns, nor whitespace after the
end-of-turn token.

How: the template renders the conversation incrementally. For assistant message k, the render of
``messages[:k]`` with the generation prompt ends where its content starts, and the render of
``messages[:k+1]`` (right-stripped) ends just after its end-of-turn token; each must be a text
prefix of the full render. The full text is cut at those points and the pieces tokenised
separately; when the pieces' tokens concatenate to the full text's tokens (token-prefix
consistency, true for ChatML and Llama 3), each token's mask is its piece's. Otherwise a token
is masked when its characters (``return_offsets_mapping``) overlap an assistant span. A
template whose prefixes are not text prefixes of the full render (e.g. one that drops earlier
reasoning) falls back to locating each assistant content in the full text.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from eagle3_jax.data.sources import DataError

# End-of-turn markers tried by the text-search fallback only.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>",
                "<|endoftext|>")


def load_tokenizer(target: str | Path | None = None):
    """The transformers tokenizer of a target: a preset name (default ``smollm2-135m``), a
    ``.gguf`` file or an HF checkpoint folder. Only the tokenizer is read, not the weights."""
    from eagle3_jax.presets import DEFAULT_PRESET, PresetError, list_presets, load_preset
    from eagle3_jax.text.tokenizer import ChatTokenizer, TokenizerError

    target = str(target or DEFAULT_PRESET)
    path = Path(target)
    try:
        if path.is_dir():
            return ChatTokenizer.from_hf_folder(path).hf
        if path.is_file() and path.suffix in (".yaml", ".yml") or (
                not path.exists() and target in list_presets()):
            preset = load_preset(target)
            if preset.weights is None:
                raise DataError(f"preset {preset.name!r} ships no tokenizer; pass --target "
                                "/path/to/hf/folder")
            from eagle3_jax.checkpoints.default_model import default_model_path

            return ChatTokenizer.from_gguf(default_model_path()).hf
        if path.is_file():
            return ChatTokenizer.from_gguf(path).hf
    except (TokenizerError, PresetError) as e:
        raise DataError(str(e).splitlines()[0]) from None
    raise DataError(f"target {target!r} is not a preset ({', '.join(list_presets())}), a .gguf "
                    "file or an HF folder")


def _hf(tokenizer: Any) -> Any:
    return getattr(tokenizer, "hf", tokenizer)  # accept a ChatTokenizer or a transformers one


def _render(hf: Any, messages: Sequence[Mapping], generation_prompt: bool) -> str:
    return hf.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                  add_generation_prompt=generation_prompt)


def assistant_char_spans(tokenizer: Any, messages: Sequence[Mapping]) -> tuple[str, list]:
    """(full rendered text, [(start, end) character span of each assistant turn to learn]).

    A span starts after the assistant header and ends after the end-of-turn token.
    """
    hf = _hf(tokenizer)
    full = _render(hf, messages, False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _render(hf, messages[:k], True)
        turn = _render(hf, messages[:k + 1], False).rstrip()
        if not (full.startswith(turn) and turn.startswith(head)):
            return full, _search_spans(full, messages)
        spans.append((len(head), len(turn)))
    return full, spans


def _search_spans(full: str, messages: Sequence[Mapping]) -> list:
    # The template is not prefix-consistent: find each assistant content, in order, in the text.
    spans, cursor = [], 0
    for m in messages:
        if m["role"] != "assistant":
            continue
        content = m["content"].strip()
        start = full.find(content, cursor)
        if start < 0:
            continue  # the template rewrote this turn; it cannot be located, so is not learned
        end = start + len(content)
        rest = full[end:]
        eot = next((t for t in _END_OF_TURN if rest.lstrip(" ").startswith(t)), None)
        if eot is not None:
            end = full.index(eot, end) + len(eot)
        spans.append((start, end))
        cursor = end
    return spans


def tokenize_conversation(
    tokenizer: Any, messages: Sequence[Mapping], *, max_len: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [T] int32 and loss mask [T] bool of one conversation, T <= max_len.

    ``messages``: [{role, content}], roles system/user/assistant. Trailing non-assistant
    messages carry no loss and are left out.
    """
    hf = _hf(tokenizer)
    messages = list(messages)
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not messages:
        return np.zeros((0,), np.int32), np.zeros((0,), bool)
    full, spans = assistant_char_spans(hf, messages)

    cuts = sorted({0, len(full), *(c for span in spans for c in span)})
    pieces = [full[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    piece_ids = hf(pieces, add_special_tokens=False)["input_ids"] if pieces else []
    ids = hf(full, add_special_tokens=False)["input_ids"]
    if [t for p in piece_ids for t in p] == list(ids):
        # Cuts include every span boundary, so a piece is wholly inside a span or outside all.
        mask = []
        for a, p in zip(cuts[:-1], piece_ids):
            mask.extend([any(s <= a < e for s, e in spans)] * len(p))
    else:  # token boundaries straddle the cuts: fall back to character offsets
        try:
            enc = hf(full, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:
            raise DataError("the tokenizer's chat template is not token-prefix consistent and "
                            "the tokenizer gives no offsets (a slow tokenizer)") from None
        ids = enc["input_ids"]
        offsets = np.array(enc["offset_mapping"], np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), bool)
        for s, e in spans:  # any overlap: a token straddling the header/content cut is learned
            mask |= (offsets[:, 0] < e) & (offsets[:, 1] > s)
    ids = np.asarray(ids, np.int32)[:max_len]
    return ids, np.asarray(mask, bool)[:max_len]


@dataclasses.dataclass
class TokenizedRecords:
    """Tokenised conversations stored flat: record i is ``tokens[offsets[i]:offsets[i+1]]``.

    A grain random-access source: ``records[i] -> {"input_ids": [T] int32, "loss_mask": [T]
    bool}``. Saved as one ``.npz`` (tokens, loss_mask, offsets, ids).
    """

    tokens: np.ndarray     # [N_tokens] int32
    loss_mask: np.ndarray  # [N_tokens] bool
    offsets: np.ndarray    # [N + 1] int64
    ids: np.ndarray        # [N] str, conversation ids

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return {"input_ids": self.tokens[a:b], "loss_mask": self.loss_mask[a:b]}

    @classmethod
    def from_arrays(cls, rows: Iterable[tuple[np.ndarray, np.ndarray]],
                    ids: Sequence[str] | None = None) -> "TokenizedRecords":
        rows = list(rows)
        lengths = np.array([len(t) for t, _ in rows], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros((0,), dt)
        ids = np.array(list(ids) if ids is not None else [str(i) for i in range(len(rows))])
        return cls(cat([t for t, _ in rows], np.int32), cat([m for _, m in rows], bool),
                   offsets, ids.astype(str))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part.npz")
        np.savez(tmp, tokens=self.tokens, loss_mask=self.loss_mask, offsets=self.offsets,
                 ids=self.ids)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "TokenizedRecords":
        """From a ``.npz`` written by :meth:`save` or a ``.jsonl`` of {input_ids, loss_mask}."""
        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenized records file {path} does not exist")
        if path.suffix == ".jsonl":
            return _load_jsonl(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                return cls(z["tokens"], z["loss_mask"], z["offsets"], z["ids"])
        except (OSError, KeyError, ValueError) as e:
            raise DataError(f"{path}: not a tokenized-records .npz ({e})") from None


def _load_jsonl(path: Path) -> TokenizedRecords:
    rows, ids = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                t, m = np.asarray(r["input_ids"], np.int32), np.asarray(r["loss_mask"], bool)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise DataError(f"{path}: record on line {lineno} is malformed ({e})") from None
            if t.ndim != 1 or t.shape != m.shape:
                raise DataError(f"{path}: record on line {lineno}: input_ids and loss_mask "
                                "must be 1-D lists of the same length")
            rows.append((t, m))
            ids.append(str(r.get("id", len(ids))))
    if not rows:
        raise DataError(f"{path}: no records")
    return TokenizedRecords.from_arrays(rows, ids)


def tokenize_conversations(
    tokenizer: Any,
    conversations: Iterable[Mapping],
    *,
    max_len: int = 2048,
    progress: bool = False,
) -> tuple[TokenizedRecords, int]:
    """Tokenise normalised conversations ({id, conversations}); returns (records, skipped).

    Conversations with no loss-masked token left after truncation to ``max_len`` are skipped.
    """
    conversations = list(conversations)
    items: Iterable = conversations
    if progress:
        from tqdm import tqdm

        items = tqdm(conversations, desc="tokenizing", unit=" conv")
    rows, ids, skipped = [], [], 0
    for conv in items:
        t, m = tokenize_conversation(tokenizer, conv["conversations"], max_len=max_len)
        if not m.any():
            skipped += 1
            continue
        rows.append((t, m))
        ids.append(str(conv.get("id", len(ids))))
    if not rows:
        raise DataError(f"no conversation has an assistant token within max_len={max_len}")
    return TokenizedRecords.from_arrays(rows, ids), skipped
