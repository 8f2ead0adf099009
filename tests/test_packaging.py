"""What the wheel ships: every config, the benchmark prompts, the shipped draft heads and the five
console scripts; and an installed (non-editable) copy finds its presets from another folder.

The wheel is built from a copy of the build's inputs (pyproject, README, the package, configs/)
so the checkout gets no build/ or egg-info; the copy keeps eagle3_jax/configs a symlink, as git
has it, so the test sees what a real build from the repository sees.
"""

from __future__ import annotations

import configparser
import importlib
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KERNEL_EXPECTED = platform.machine() == "x86_64" and shutil.which("c++") is not None
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "eagle3_jax", "configs")
CONSOLE_SCRIPTS = {
    "eagle3-decode": "eagle3_jax.decode:main",
    "eagle3-train": "eagle3_jax.train.__main__:main",
    "eagle3-data": "eagle3_jax.data.__main__:main",
    "eagle3-export": "eagle3_jax.export:main",
    "eagle3-bench": "eagle3_jax.bench.__main__:main",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
        else:
            shutil.copy2(REPO / name, src / name)
    assert (src / "eagle3_jax" / "configs").is_symlink()
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: the build uses this environment's setuptools (the test extra's) and
    # needs no network.
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = out.glob("eagle3_jax-*.whl")
    return path


@pytest.mark.slow  # builds the wheel, C++ kernels included
def test_wheel_ships_configs_prompts_and_scripts(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        configs = sorted(REPO.glob("configs/*.yaml"))
        assert len(configs) >= 7
        for path in configs:
            shipped = f"eagle3_jax/configs/{path.name}"
            assert shipped in names
            assert zf.read(shipped) == path.read_bytes()  # the file itself, not a link
        prompts = REPO / "eagle3_jax" / "bench" / "prompts"
        for path in prompts.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                assert f"eagle3_jax/bench/prompts/{path.relative_to(prompts)}" in names, path
        heads = REPO / "eagle3_jax" / "heads"  # the shipped draft heads, whole
        for path in heads.rglob("*") if heads.is_dir() else ():
            if path.is_file() and "__pycache__" not in path.parts:
                assert f"eagle3_jax/heads/{path.relative_to(heads)}" in names, path
        kernel = REPO / "eagle3_jax" / "kernels" / "cpu"  # the CPU kernel's source and headers
        for path in kernel.rglob("*"):
            if path.is_file():
                assert f"eagle3_jax/kernels/cpu/{path.relative_to(kernel)}" in names, path
        if KERNEL_EXPECTED:  # built by the wheel's build, with this machine's compiler
            assert any(n.startswith("eagle3_jax/kernels/_cpu_kernels") and n.endswith(".so")
                       for n in names), sorted(n for n in names if "kernels" in n)
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.read_string(zf.read(entry_points).decode())
    assert dict(parser["console_scripts"]) == CONSOLE_SCRIPTS


@pytest.mark.parametrize("target", sorted(CONSOLE_SCRIPTS.values()))
def test_console_script_targets_exist(target):
    module, _, func = target.partition(":")
    assert callable(getattr(importlib.import_module(module), func))


@pytest.mark.slow
def test_installed_wheel_finds_its_configs_from_another_folder(wheel, tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q",
                           "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    code = ("import eagle3_jax, eagle3_jax.presets as p, eagle3_jax.train.config as t; "
            "print(eagle3_jax.__file__); print(' '.join(p.list_presets())); "
            "print(' '.join(p.list_train_configs())); "
            "print(t.load_train_config('train-smollm2-135m').target); "
            "import eagle3_jax.kernels as k; print(k.kernel_status())")
    # The installed copy comes first on the path, ahead of this checkout (editable or not).
    env = dict(os.environ, PYTHONPATH=str(site))
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    where, presets, train_configs, target, kernel = done.stdout.splitlines()
    if KERNEL_EXPECTED:
        assert "in use" in kernel and str(site) in kernel, kernel
    assert Path(where).is_relative_to(site)
    from eagle3_jax.presets import list_presets, list_train_configs

    assert presets.split() == list_presets()
    assert train_configs.split() == list_train_configs()
    assert target == "smollm2-135m"
