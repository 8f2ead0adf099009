"""Compiled programs against Linux's limit on memory mappings per process (vm.max_map_count).

Each compiled CPU program holds memory mappings of its own; a process that reaches the limit
cannot map the next program's code and XLA crashes raising that failure. The decoders' compile
cache drops every compiled program before compiling where the process is near the limit
(``eagle3_jax.compile_cache.near_mapping_limit``).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import pytest

from eagle3_jax import compile_cache
from eagle3_jax.decoding import decoders

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@linux_only
def test_memory_mappings_reads_the_process_and_the_kernel_limit():
    count, limit = compile_cache.memory_mappings()
    with open("/proc/sys/vm/max_map_count") as f:
        assert limit == int(f.read())
    with open("/proc/self/maps") as f:
        listed = len(f.readlines())
    assert 0 < count <= limit
    assert abs(count - listed) < 50  # the process maps a little between the two reads
    assert compile_cache.near_mapping_limit(high_water=1.0) is None
    assert compile_cache.near_mapping_limit(high_water=0.0)[1] == limit


@linux_only
def test_dropping_compiled_programs_unmaps_their_code():
    x = jnp.ones((3,))
    for i in range(30):  # 30 distinct programs
        jax.jit(lambda v, i=i: jnp.sin(v) * i + jnp.cos(v * (i + 1)))(x).block_until_ready()
    before, _ = compile_cache.memory_mappings()
    compile_cache.drop_compiled_programs()
    after, _ = compile_cache.memory_mappings()
    assert after < before


def test_compile_cache_drops_its_programs_near_the_limit(monkeypatch):
    messages, compiled = [], []
    cache = decoders.CompileCache(messages.append)

    def compile_fn(name):
        def make():
            compiled.append(name)
            return name
        return make

    monkeypatch.setattr(decoders, "near_mapping_limit", lambda: None)
    assert cache.get("a", "plain", (1, 64), compile_fn("a")) == "a"
    assert cache.get("a", "plain", (1, 64), compile_fn("a")) == "a"  # cached
    assert compiled == ["a"]
    dropped = []
    monkeypatch.setattr(decoders, "near_mapping_limit", lambda: (60000, 65530))
    monkeypatch.setattr(decoders, "drop_compiled_programs", lambda: dropped.append(True))
    assert cache.get("b", "plain", (1, 128), compile_fn("b")) == "b"
    assert dropped == [True]
    assert any("60000 memory mappings of the 65530" in m and "vm.max_map_count" in m
               for m in messages), messages
    monkeypatch.setattr(decoders, "near_mapping_limit", lambda: None)
    assert cache.get("b", "plain", (1, 128), compile_fn("b")) == "b"  # kept: compiled after
    assert cache.get("a", "plain", (1, 64), compile_fn("a")) == "a"  # dropped: compiles again
    assert compiled == ["a", "b", "a"]
