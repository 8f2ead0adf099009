"""Hugging Face hub ids (``org/name``) as targets and draft heads, resolved as transformers
resolves them: through the local hub cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``), downloading what is missing when online, reading the cache only
when ``HF_HUB_OFFLINE=1``. ``huggingface_hub`` does the work (transformers depends on it).

    resolve_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct", TARGET_FILES) -> snapshot folder
"""

from __future__ import annotations

import os
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


def hub_cache_dir() -> Path:
    """The hub cache transformers reads: ``HF_HUB_CACHE``, ``HF_HOME/hub``, or the default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or transformers' ``TRANSFORMERS_OFFLINE``) set to a true value."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve_hub_id(repo_id: str, patterns: tuple[str, ...]) -> Path:
    """The local snapshot folder of ``repo_id`` with the files matching ``patterns``: from the
    cache, downloading what is missing unless offline. Raises :class:`HubError`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = hub_offline()
    cache = hub_cache_dir()
    try:
        folder = snapshot_download(repo_id, cache_dir=cache, allow_patterns=list(patterns),
                                   local_files_only=offline)
    except LocalEntryNotFoundError:
        where = "offline (HF_HUB_OFFLINE=1)" if offline else "and the hub could not be reached"
        raise HubError(f"{repo_id!r} is not in the Hugging Face cache {cache} {where}") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubError(f"{repo_id!r} could not be fetched from the Hugging Face hub into {cache}: "
                       f"{first}") from None
    return Path(folder)
