"""Chat tokenizer: a thin wrapper over a transformers tokenizer (no torch, no hub access).

``ChatTokenizer.from_gguf`` builds the tokenizer (and chat template) that transformers derives
from GGUF metadata. That conversion takes ~4 s for SmolLM2 (49k tokens + merges), so the result
is saved with ``save_pretrained`` under ``$EAGLE3_JAX_HOME/tokenizers/`` and later starts reload
it in ~0.25 s. ``from_hf_folder`` reads an HF checkpoint folder with ``local_files_only``.

Encoding, decoding and the chat template run on :class:`eagle3_jax.text.light.LightTokenizer`
when the saved folder allows it, so a start that only decodes never imports transformers
(seconds); :attr:`ChatTokenizer.hf`, the transformers tokenizer itself, is built on first use
(the data pipeline needs it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping, Sequence

from eagle3_jax.errors import Eagle3Error
from eagle3_jax.text.light import LightTokenizer


# Everything is local; never let transformers try the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# End-of-turn markers of common chat templates; any present in the vocabulary stops generation.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>",
                      "<|end_of_text|>", "<end_of_turn>", "</s>")


class TokenizerError(Eagle3Error, ValueError):
    """A tokenizer that cannot be built from the given files; the message says why."""


class ChatTokenizer:
    """Chat-template rendering, encoding and decoding with token-id lists in and out.

    Attributes:
      hf: the transformers tokenizer (built from ``folder`` on first use when not given).
      source: where it came from (for messages).
    """

    def __init__(self, hf_tokenizer: Any = None, source: str = "",
                 extra_eos_ids: Sequence[int] = (), *, folder: str | Path | None = None):
        if hf_tokenizer is None and folder is None:
            raise TypeError("ChatTokenizer needs a transformers tokenizer or a saved folder")
        self._hf, self._folder = hf_tokenizer, folder
        self._light = LightTokenizer.from_folder(folder) if hf_tokenizer is None else None
        self.source = source
        self._extra_eos_ids = tuple(int(i) for i in extra_eos_ids)

    @property
    def hf(self) -> Any:
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(self._folder, local_files_only=True)
        return self._hf

    @property
    def _backend(self) -> Any:
        """What encodes, decodes and renders: the light tokenizer when it can, else ``hf``."""
        return self._light if self._light is not None else self.hf

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path, *, cache: bool = True) -> "ChatTokenizer":
        """Tokenizer and chat template from a GGUF file's metadata (cached after the first call)."""
        path = Path(path).resolve()
        if not path.is_file():
            raise TokenizerError(f"GGUF file {path} does not exist")
        cached = _gguf_cache_dir(path) if cache else None
        if cached is not None and (cached / "tokenizer_config.json").is_file():
            tok = cls(source=str(path), folder=cached)
            try:
                tok.eos_token_ids  # noqa: B018 - reads the folder (light or transformers)
                return tok
            except Exception:  # a damaged cache entry: rebuild it below
                shutil.rmtree(cached, ignore_errors=True)
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name,
                                                local_files_only=True)
        except Exception as e:
            if _torch_importable():
                raise TokenizerError(f"cannot build a tokenizer from {path}: {e}") from e
            # transformers' GGUF reader imports torch; without torch, build it from the same
            # metadata ourselves.
            try:
                tok = _gguf_tokenizer_without_torch(path)
            except Exception as e2:
                raise TokenizerError(f"cannot build a tokenizer from {path}: {e2}") from e2
        if cached is not None:
            _save_atomically(tok, cached)
        return cls(tok, str(path))

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> "ChatTokenizer":
        """Tokenizer of an HF checkpoint folder; ``generation_config.json`` eos ids are kept."""
        from transformers import AutoTokenizer

        path = Path(path)
        try:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:
            raise TokenizerError(f"cannot load a tokenizer from {path} ({e}); the folder needs "
                                 "tokenizer.json or tokenizer_config.json") from e
        extra: list[int] = []
        gen_config = path / "generation_config.json"
        if gen_config.is_file():
            eos = json.loads(gen_config.read_text()).get("eos_token_id")
            extra = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(tok, str(path), extra)

    # -- text <-> ids ----------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of ``messages`` ([{"role", "content"}, ...]) rendered by the chat template."""
        ids = self._backend.apply_chat_template(list(messages), tokenize=True,
                                          add_generation_prompt=add_generation_prompt,
                                          return_dict=False)
        if isinstance(ids, Mapping):  # some transformers versions ignore return_dict=False
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def render_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The chat template's text for ``messages`` (what :meth:`apply_chat_template` encodes)."""
        return self._backend.apply_chat_template(list(messages), tokenize=False,
                                           add_generation_prompt=add_generation_prompt)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's BOS if it adds one, like HF's default)."""
        return [int(i) for i in self._backend.encode(text, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- special ids -----------------------------------------------------------------------

    @cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS plus every end-of-turn token in the vocabulary, sorted, without duplicates."""
        vocab = self._backend.get_vocab()
        ids = {int(self._backend.eos_token_id)} if self._backend.eos_token_id is not None else set()
        ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
        ids.update(self._extra_eos_ids)
        return tuple(sorted(ids))

    @property
    def pad_token_id(self) -> int:
        """The tokenizer's pad id, else the first EOS id (padding is always masked anyway)."""
        pad = self._backend.pad_token_id
        return int(pad) if pad is not None else self.eos_token_ids[0]

    @property
    def vocab_size(self) -> int:
        return len(self._backend)

    def __repr__(self) -> str:
        return f"ChatTokenizer({self.source!r}, vocab={self.vocab_size})"


def _torch_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["torch"] is None
        return False


def _gguf_tokenizer_without_torch(path: Path) -> Any:
    """What ``AutoTokenizer.from_pretrained(..., gguf_file=...)`` builds, minus its torch import.

    Mirrors transformers' ``get_gguf_tokenizer`` (which reads metadata with a torch-importing
    reader) using ``gguf.GGUFReader``, then calls transformers' own ``convert_gguf_tokenizer``.
    """
    import gguf
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS, GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer,
    )

    reader = gguf.GGUFReader(path)
    metadata = {k: f.contents() for k, f in reader.fields.items()
                if k.startswith("tokenizer.") or k == "general.architecture"}
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer)
    config.update(extra)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config)


def _gguf_cache_dir(path: Path) -> Path:
    from eagle3_jax.checkpoints.default_model import cache_dir

    stat = path.stat()
    key = hashlib.sha1(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "tokenizers" / f"{path.stem}-{key}"


def _save_atomically(tok: Any, dest: Path) -> None:
    # Save into a temporary sibling, then rename: concurrent starts never see a half-written
    # folder. A failure to cache (read-only home, race lost) is not an error.
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, dest)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass
