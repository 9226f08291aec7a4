"""The five KV-cache modes: choosing one (arguments over environment), sizing it, and building it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyloop.cache.base import ModeCache
from tinyloop.cache.dense import DenseKVCache
from tinyloop.cache.hidden import HiddenStateCache
from tinyloop.cache.int8 import Int8KVCache
from tinyloop.cache.memory import check_host_memory
from tinyloop.cache.window import WindowKVCache
from tinyloop.config import ArchConfig
from tinyloop.env import RuntimeEnv
from tinyloop.log import detail

KV_MODES = ("16bit", "int8", "window", "hidden", "none")


@dataclass(frozen=True)
class KVModeChoice:
    """mode: one of KV_MODES; window: positions kept per slot (mode "window" only, else 0)."""

    mode: str
    window: int = 0

    def describe(self) -> str:
        return f"window={self.window}" if self.mode == "window" else self.mode


def resolve_kv_mode(env: RuntimeEnv, kv_mode: str | None, cache_window: int | None) -> KVModeChoice:
    """Arguments win over TINYLOOP_KV_INT8 / TINYLOOP_KV_H_MODE / TINYLOOP_DISABLE_KV_CACHE."""
    if cache_window is not None and (
        isinstance(cache_window, bool) or not isinstance(cache_window, int) or cache_window < 0
    ):
        raise ValueError(f"cache_window must be an integer >= 0 (0 = full cache), got {cache_window!r}")
    window = cache_window or 0
    if kv_mode is None:
        if env.disable_kv_cache:
            kv_mode = "none"  # a debugging switch: it forces uncached generation whatever else is set
        elif env.kv_int8 and env.kv_h_mode:
            raise ValueError("TINYLOOP_KV_INT8 and TINYLOOP_KV_H_MODE cannot both be set; unset one of them")
        elif env.kv_int8:
            kv_mode = "int8"
        elif env.kv_h_mode:
            kv_mode = "hidden"
        else:
            kv_mode = "window" if window else "16bit"
        if window and kv_mode not in ("window", "none"):
            flag = "TINYLOOP_KV_INT8" if kv_mode == "int8" else "TINYLOOP_KV_H_MODE"
            raise ValueError(f"cache_window > 0 cannot be combined with {flag}=1; unset it or use cache_window=0")
    if kv_mode not in KV_MODES:
        raise ValueError(f"kv_mode must be one of {list(KV_MODES)}, got {kv_mode!r}")
    if kv_mode == "window" and not window:
        raise ValueError("kv_mode 'window' needs cache_window > 0 (the number of positions to keep)")
    if kv_mode == "16bit" and window:
        kv_mode = "window"
    if window and kv_mode not in ("window", "none"):
        raise ValueError(f"cache_window > 0 only works with kv_mode '16bit' or 'window', not {kv_mode!r}")
    return KVModeChoice(kv_mode, window if kv_mode == "window" else 0)


def kv_bytes_per_token(
    choice: KVModeChoice, cfg: ArchConfig, loops: int, dtype: torch.dtype, storage_dtype: torch.dtype | None = None
) -> int:
    """Cache bytes one token of context costs at `loops` (a window caps the count of such tokens)."""
    slots = cfg.n_cache_slots(loops)
    elt = torch.empty((), dtype=storage_dtype or dtype).element_size()
    if choice.mode in ("16bit", "window"):
        return slots * 2 * cfg.kv_dim * elt
    if choice.mode == "int8":
        return slots * 2 * (cfg.kv_dim + 2 * cfg.n_kv_heads)  # int8 values + one float16 scale per head
    if choice.mode == "hidden":
        return slots * cfg.d_model * torch.empty((), dtype=dtype).element_size()
    return 0


def make_cache(
    choice: KVModeChoice,
    cfg: ArchConfig,
    batch: int,
    max_seq: int,
    loops: int,
    device: torch.device,
    dtype: torch.dtype,
    storage_dtype: torch.dtype | None = None,
) -> ModeCache | None:
    """A working cache of the chosen mode (None for "none"). storage_dtype: "16bit" only, e.g. float16
    on CPU where the compute dtype is float32."""
    if storage_dtype is not None and choice.mode != "16bit":
        raise ValueError(f"storage_dtype only applies to the '16bit' KV mode, not {choice.mode!r}")
    if choice.mode == "none":
        return None
    tokens = min(max_seq, choice.window) if choice.mode == "window" else max_seq
    check_host_memory(device, batch * tokens * kv_bytes_per_token(choice, cfg, loops, dtype, storage_dtype))
    cache: ModeCache
    if choice.mode == "16bit":
        cache = DenseKVCache(cfg, batch, max_seq, loops, device, dtype, storage_dtype)
    elif choice.mode == "int8":
        cache = Int8KVCache(cfg, batch, max_seq, loops, device, dtype)
    elif choice.mode == "hidden":
        cache = HiddenStateCache(cfg, batch, max_seq, loops, device, dtype)
    else:
        cache = WindowKVCache(cfg, batch, max_seq, loops, device, dtype, min(choice.window, max_seq))
    stored = storage_dtype or dtype
    detail(
        f"allocated a {choice.mode} KV cache: {cfg.n_cache_slots(loops)} slots (loops {loops}) x {tokens} positions "
        f"x batch {batch}, {'int8' if choice.mode == 'int8' else str(stored).removeprefix('torch.')}, "
        f"{cache.nbytes / 2**20:.2f} MiB on {device}"
    )
    return cache
