"""Shared pytest fixtures.

The suite runs on 8 emulated CPU devices (``make test`` sets XLA_FLAGS; we set the same default
here, before anything imports jax, so a bare ``pytest`` matches). The real SmolLM2 GGUF and
transformers' own float32 model of it are loaded once per session: the transformers load
dequantizes 272 tensors and takes ~15 s on two cores.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The start-up caches under $EAGLE3_JAX_HOME stay off in the test process (every test reads its
# source fresh, and no test run leaves entries in the user's home); tests/test_startup.py turns
# them on in temporary homes.
os.environ.setdefault("EAGLE3_JAX_WEIGHTS_CACHE", "0")
# JAX's persistent compilation cache stays off in the test processes and the CLIs they start
# (tests/test_startup.py turns it on in temporary homes): shared across the xdist workers it
# saved no time (a full run on a 2-core AVX-512 machine: 1455 s for 702 tests with it, 1103 s
# for the first 652 without). EAGLE3_JAX_COMPILE_CACHE=<dir> turns it on for a run (every
# process then reads and writes that directory).
os.environ.setdefault("EAGLE3_JAX_COMPILE_CACHE", "0")

from eagle3_jax.compile_cache import (drop_compiled_programs, enable_compile_cache,  # noqa: E402
                                      memory_mappings)

enable_compile_cache()

import pytest  # noqa: E402


def _mapped_regions() -> int:
    """Memory mappings of this process (Linux), 0 where /proc is absent."""
    mappings = memory_mappings()
    return mappings[0] if mappings else 0


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """After each test file, drop JAX's caches of traced and compiled programs (and collect
    what only they held). Every compiled CPU program keeps its machine code in memory mappings
    of its own, and an xdist worker runs many files: without this, a worker of the full suite
    reached Linux's limit of 65530 mappings per process (``vm.max_map_count``), the next
    compilation failed to map its code, and raising that error crashed the worker (a
    segmentation fault unwinding the C++ exception). EAGLE3_JAX_TEST_MAPS=1 (with ``-s``)
    prints each file's mappings before and after."""
    yield
    show = os.environ.get("EAGLE3_JAX_TEST_MAPS")
    before = _mapped_regions() if show else 0
    drop_compiled_programs()
    if show:
        print(f"\n[maps: {before} -> {_mapped_regions()}]", file=sys.stderr)


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    """Path of the cached SmolLM2-135M-Instruct Q4_1 GGUF (fetched by ``make model``)."""
    from eagle3_jax.checkpoints.default_model import ModelUnavailableError, default_model_path

    try:
        return default_model_path()
    except ModelUnavailableError as e:
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path):
    """transformers' float32 eval-mode LlamaForCausalLM loaded from the same GGUF."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name, dtype=torch.float32,
        local_files_only=True,
    )
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    """Our ChatTokenizer for the default model (cached next to the GGUF after the first run)."""
    from eagle3_jax.text import ChatTokenizer

    return ChatTokenizer.from_gguf(smollm2_gguf_path)


def pytest_collection_modifyitems(config, items):
    """Every test that reads the real SmolLM2 file (through the fixtures above) is ``slow``, so
    ``make test-fast`` (``-m "not slow"``) is the random-weights suite."""
    for item in items:
        if "smollm2_gguf_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
