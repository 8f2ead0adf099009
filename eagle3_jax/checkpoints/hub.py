"""Hugging Face hub ids (``org/name``) as targets and draft heads, resolved as transformers
resolves them: ``huggingface_hub.snapshot_download`` reads the local hub cache (``HF_HUB_CACHE``,
else ``HF_HOME/hub``), downloads what is missing when online and reads the cache alone when
``HF_HUB_OFFLINE=1`` (transformers depends on ``huggingface_hub``).

    resolve_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct", TARGET_FILES) -> snapshot folder
"""

from __future__ import annotations

import re
from pathlib import Path

# What a target and a head need from a repository (no other weights formats, no images).
TARGET_FILES = ("config.json", "generation_config.json", "*.safetensors",
                "*.safetensors.index.json", "tokenizer*", "special_tokens_map.json",
                "chat_template.*", "vocab.json", "merges.txt")
HEAD_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json", "acceptance.json",
              "README.md")

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


class HubError(Exception):
    """A hub id that neither the cache nor the hub could give (the reason in one line)."""


def is_hub_id(name: str) -> bool:
    """``org/name`` as the hub spells repository ids (not checked for existence)."""
    return bool(_HUB_ID.fullmatch(str(name))) and ".." not in str(name)


def resolve_hub_id(repo_id: str, patterns: tuple[str, ...]) -> Path:
    """The local snapshot folder of ``repo_id`` with the files matching ``patterns``: from the
    cache, downloading what is missing unless offline. Raises :class:`HubError`."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(patterns)))
    except LocalEntryNotFoundError:
        where = ("offline (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE
                 else "and the hub could not be reached")
        raise HubError(f"{repo_id!r} is not in the Hugging Face cache {constants.HF_HUB_CACHE} "
                       f"{where}") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubError(f"{repo_id!r} could not be fetched from the Hugging Face hub into "
                       f"{constants.HF_HUB_CACHE}: {first}") from None
