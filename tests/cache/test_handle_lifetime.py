"""Handles own their memory: nbytes, close(), freed with the last reference and when the model closes;
memory reports per KV mode; out-of-memory errors; the CLI's --cache-window."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest

import tinyloop
import tinyloop.cache.memory as memory
from tinyloop.api.model import Model
from tinyloop.cache.pool import PrefixPool

PROMPT = np.arange(60, 90, dtype=np.int32)


def test_close_frees_a_handle_and_later_use_raises(models) -> None:
    m = models["16bit"]
    pc = m.build_prefix_cache(PROMPT, loops=2)
    assert pc.nbytes > 0
    pc.close()
    assert pc.closed and pc.nbytes == PROMPT.nbytes
    with pytest.raises(RuntimeError, match="prefix cache was closed"):
        m.generate_from_prefix_cache(pc, [1], 2)
    with pytest.raises(ValueError, match="closed prefix cache"):
        PrefixPool().register(pc)
    pool = PrefixPool()
    short, long = m.build_prefix_cache(PROMPT[:10], loops=2), m.build_prefix_cache(PROMPT, loops=2)
    pool.register(short)
    pool.register(long)
    long.close()  # a closed entry is dropped when a lookup reaches it; the next best one serves
    match = pool.lookup(PROMPT, 2)
    assert match is not None and match.item is short and long not in pool
    assert pool.stats()["removed"] == 1
    pool.check_integrity()


def test_memory_goes_with_the_last_reference(models) -> None:
    m = models["int8"]
    handle = m.build_resume_handle(PROMPT, loops=2)
    tensor_ref = weakref.ref(handle.kv()["k"])
    state_ref = weakref.ref(handle.state()[0])
    before = m.vram_usage_mb()
    del handle
    assert tensor_ref() is None and state_ref() is None  # reference counting, no gc pass needed
    assert m.vram_usage_mb() < before


def test_closing_the_model_invalidates_its_handles(tiny_files) -> None:
    m = Model(tiny_files["f32"], max_seq_len=64, kv_mode="hidden")
    pc = m.build_prefix_cache(PROMPT, loops=2)
    handle = m.build_resume_handle(PROMPT, loops=2)
    pool = PrefixPool()
    m.register_prefix(pool, pc)
    m.close()
    assert pc.closed and handle.closed and len(pool) == 0
    with Model(tiny_files["f32"], max_seq_len=64, kv_mode="hidden") as again:
        with pytest.raises(RuntimeError, match="^model was closed$"):
            again.generate_from_prefix_cache(pc, [1], 2)
        with pytest.raises(RuntimeError, match="^model was closed$"):
            again.resume_generate(handle, loops=3, max_tokens=2)
    with pytest.raises(RuntimeError, match="^model was closed$"):
        m.build_prefix_cache(PROMPT)


def test_vram_usage_counts_each_mode_and_live_handles(models) -> None:
    usage = {}
    for mode, m in models.items():
        m.generate(PROMPT, max_tokens=2, loops=4, temperature=0.0)
        usage[mode] = m.vram_usage_mb()
    assert usage["none"] < usage["window"] < usage["int8"] < usage["hidden"] <= usage["16bit"]
    m = models["16bit"]
    per_token = m.kv_bytes_per_token(4)
    assert per_token == m.header.config.n_cache_slots(4) * 2 * m.header.config.kv_dim * 4
    assert models["none"].kv_bytes_per_token(4) == 0 and models["int8"].kv_bytes_per_token(4) < per_token
    before = m.vram_usage_mb()
    pc = m.build_prefix_cache(PROMPT, loops=4)
    assert m.vram_usage_mb() == pytest.approx(before + pc.nbytes / 2**20)
    del pc
    gc.collect()


def test_out_of_memory_is_a_runtime_error_starting_with_out_of_memory(tiny_files, monkeypatch) -> None:
    with Model(tiny_files["f32"], max_seq_len=64) as m:
        pc = m.build_prefix_cache(PROMPT, loops=2)
        monkeypatch.setattr(memory, "available_host_bytes", lambda: 1024)
        for call in (
            lambda: m.build_prefix_cache(PROMPT, loops=2),
            lambda: m.generate(PROMPT, max_tokens=2, loops=9),  # a larger working cache
        ):
            with pytest.raises(RuntimeError, match="^out of memory"):
                call()
        del pc


def test_public_names() -> None:
    assert tinyloop.PrefixPool is PrefixPool
    assert tinyloop.PrefixCache.__name__ == "PrefixCache" and tinyloop.ResumeHandle.__name__ == "ResumeHandle"


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[bytes]:
    full = {**os.environ, "TINYLOOP_LOG_LEVEL": "0", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        [sys.executable, "-m", "tinyloop.cli.main", *args], capture_output=True, timeout=120, env=full
    )


def test_cli_cache_window(tiny_files) -> None:
    path = str(tiny_files["f32"])
    args = ("generate", "--prompt", "hello there", "--max-tokens", "6", "--temperature", "0")
    windowed = _cli(path, *args, "--cache-window", "4")
    assert windowed.returncode == 0, windowed.stderr
    with Model(tiny_files["f32"], max_seq_len=17, cache_window=4) as m:
        want = m.generate(list(b"hello there"), max_tokens=6, loops=8, temperature=0.0)  # the CLI's default loops
    assert windowed.stdout == b"hello there" + bytes(want.tolist()) + b"\n"
    res = _cli(path, *args, "--cache-window", "4", TINYLOOP_KV_INT8="1")
    lines = res.stderr.decode().strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "cache_window" in lines[0]
