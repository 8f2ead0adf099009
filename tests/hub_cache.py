"""A Hugging Face hub cache built by hand, for resolving hub ids offline in tests."""

from __future__ import annotations

import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_to_hub_cache(root: Path, repo_id: str, folder: Path) -> Path:
    """``root`` (a hub cache) holding ``folder`` as ``repo_id``'s main revision, in
    huggingface_hub's layout (models--org--name/refs/main names the snapshot's commit); returns
    the snapshot folder."""
    repo = Path(root) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def use_hub_cache(monkeypatch, root: Path) -> None:
    """``huggingface_hub`` reads ``root`` offline, as ``HF_HUB_CACHE=root HF_HUB_OFFLINE=1`` at
    start-up would have it (the library reads both when it is imported)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
