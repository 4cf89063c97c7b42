"""How much memory the KV cache may take on the device the engine runs on.

An accelerator reports its own limit and use; a CPU "device" is the host, whose available memory
(``MemAvailable``: free plus reclaimable page cache) bounds the cache the same way.
"""

from __future__ import annotations

import os

import jax


def _host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_bytes(device=None) -> int | None:
    """Bytes free for new arrays on ``device`` (default: this process's first device); None when unknown."""
    device = device if device is not None else jax.local_devices()[0]
    if device.platform == "cpu":
        return _host_available_bytes()
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return None
