"""Shared pytest fixtures.

The suite runs on 8 emulated CPU devices and compiles with LLVM's optimisations off (the flags
and why: ``tests/xla_flags.py``), set here before anything imports jax. The real SmolLM2 GGUF and
transformers' own float32 model of it are loaded once per session: the transformers load
dequantizes 272 tensors and takes ~15 s on two cores.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

from xla_flags import with_test_flags  # noqa: E402

os.environ["XLA_FLAGS"] = with_test_flags(os.environ.get("XLA_FLAGS", ""))
# The start-up caches under $EAGLE3_JAX_HOME stay off in the test process (every test reads its
# source fresh, and no test run leaves entries in the user's home); tests/test_startup.py turns
# them on in temporary homes.
os.environ.setdefault("EAGLE3_JAX_WEIGHTS_CACHE", "0")
# One JAX persistent compilation cache for the whole run, in a fresh folder: the xdist workers
# and every CLI the tests start (they inherit the environment) share it, and it keeps every
# program however quickly it compiled. Most of the suite's time is XLA compiling small programs
# (the same tiny models, eager ops and decoders again in each file, worker and subprocess); a
# program is compiled once per run and loaded after that. The run starts cold, as CI does:
# EAGLE3_JAX_COMPILE_CACHE=<dir> keeps the entries in <dir> across runs instead, =0 turns it off.
if "EAGLE3_JAX_COMPILE_CACHE" not in os.environ:
    _RUN_CACHE = tempfile.mkdtemp(prefix="eagle3_jax-tests-xla-")
    os.environ["EAGLE3_JAX_COMPILE_CACHE"] = _RUN_CACHE
    # Only the process that made the folder (the xdist controller, or a run without xdist)
    # removes it, when it exits.
    atexit.register(shutil.rmtree, _RUN_CACHE, ignore_errors=True)
os.environ.setdefault("EAGLE3_JAX_COMPILE_CACHE_MIN_SECONDS", "0")

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
def smollm2_target(smollm2_gguf_path):
    """The default target as the commands load it without ``--target`` (``load_target(None)``:
    the SmolLM2 preset, serving layout, one-device mesh), read once per session: the command
    tests that run the default model but do not test its loading share it (a read of the GGUF
    takes ~10 s on two cores; tests/test_decode_cli.py runs the decoder's own load)."""
    from eagle3_jax.checkpoints import load_target

    return load_target(None)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    """Our ChatTokenizer for the default model (cached next to the GGUF after the first run)."""
    from eagle3_jax.text import ChatTokenizer

    return ChatTokenizer.from_gguf(smollm2_gguf_path)


# Files whose single tests run for a minute or more (subprocess runs, time-boxed builds, full-size
# layers), in the order they start: the suite's workers split the collection in halves and steal
# from each other's ends (``--dist worksteal``), so long tests go first and the run ends on
# short ones instead of waiting on one long test.
RUN_FIRST = ("test_build_head_accelerator.py", "test_kernel_variants.py", "test_multihost.py",
             "test_large_presets.py", "test_bench.py", "test_packaging.py", "test_plan.py",
             "test_regenerate.py")


def pytest_collection_modifyitems(config, items):
    """Every test that reads the real SmolLM2 file (through the fixtures above) is ``slow``, as
    are the other end-to-end tests marked so in their files, so ``make test-fast``
    (``-m "not slow"``) is the random-weights suite of small models; the files of
    ``RUN_FIRST`` run first."""
    for item in items:
        if "smollm2_gguf_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(RUN_FIRST)))  # stable: file order
