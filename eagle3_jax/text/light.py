"""A saved fast tokenizer read without transformers: ``tokenizers`` + the jinja2 chat template.

Importing transformers costs seconds (it pulls torch in when torch is installed); the decoder
needs only encode, decode and the chat template, so :class:`LightTokenizer` reads a tokenizer
folder that transformers saved (``tokenizer.json``, ``tokenizer_config.json``, the chat
template in ``chat_template.jinja`` or in the config) and does those three things as
transformers' fast tokenizer does:

* encode: ``tokenizers.Tokenizer.encode(text, add_special_tokens)``;
* decode: ``Tokenizer.decode(ids, skip_special_tokens)`` (no clean-up of spaces: a folder that
  asks for it is refused, and the caller falls back to transformers);
* the chat template: rendered in jinja2's immutable sandbox with transformers' settings
  (``trim_blocks``, ``lstrip_blocks``, loop controls, its ``tojson``, ``raise_exception``,
  ``strftime_now``) and the special tokens as variables, then encoded without special tokens.

A template that uses transformers-only extensions (``{% generation %}``) is refused as well.
``tests/test_tokenizer.py`` pins this to transformers on the default model's tokenizer.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\b")


def _token_text(value: Any) -> str | None:
    if isinstance(value, Mapping):  # transformers 4 saves AddedToken dicts
        value = value.get("content")
    return value if isinstance(value, str) else None


class LightTokenizer:
    """The parts of a transformers fast tokenizer the decoder uses (same names and results)."""

    def __init__(self, backend: Any, config: Mapping[str, Any], chat_template: str | None):
        self._tok = backend
        self._special = {name: _token_text(config.get(name)) for name in _SPECIAL}
        self._template_source = chat_template
        self._template = None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "LightTokenizer | None":
        """The folder's tokenizer, or None when it needs transformers (see module docstring)."""
        folder = Path(folder)
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text())
            template_file = folder / "chat_template.jinja"
            template = (template_file.read_text() if template_file.is_file()
                        else config.get("chat_template"))
            if not isinstance(template, (str, type(None))) or config.get(
                    "clean_up_tokenization_spaces") or _GENERATION_TAG.search(template or ""):
                return None
            from tokenizers import Tokenizer

            backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except (OSError, ValueError, Exception):  # noqa: BLE001 - any doubt: use transformers
            return None
        return cls(backend, config, template)

    # -- the transformers API subset ---------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, tokenize: bool = True,
                            add_generation_prompt: bool = False, return_dict: bool = False):
        if self._template_source is None:
            raise ValueError("this tokenizer has no chat template")
        text = self._compiled().render(messages=[dict(m) for m in messages],
                                       add_generation_prompt=add_generation_prompt,
                                       tools=None, documents=None,
                                       **{k: v for k, v in self._special.items() if v})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self._special["eos_token"])

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self._special["pad_token"])

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    # ----------------------------------------------------------------------------------------

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _compiled(self):
        if self._template is None:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                  separators=separators, sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self._template_source)
        return self._template
