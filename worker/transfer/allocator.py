"""Keep freed large buffers in the process instead of handing them back to the kernel (glibc).

zmq allocates every received message part afresh (malloc of the part's size) and frees it once
the frame is written into the cache. glibc serves such sizes with mmap or trims them off the top
of the heap on free, so the next frame's buffer is fresh memory that faults in page by page,
inside the kernel's receive copy: on the development VM that made a 64 MiB transfer cost ~45 ms
of CPU instead of ~34 ms. Raising the mmap and trim thresholds keeps those buffers mapped
(the process then holds up to the transport's in-flight window, 64 MiB per sender connection,
of freed memory for reuse; tiny next to a KV cache).

A process-wide setting: done once, by the transport's constructors, and never over the
operator's own choice (MALLOC_*_ or GLIBC_TUNABLES in the environment win). Elsewhere than
glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit: parts up to 32 MiB come from the heap
TRIM_THRESHOLD = 1 << 30  # do not give the heap top back below this much free memory
TOP_PAD = 64 << 20  # grow the heap in steps of this much (one in-flight window)
_ENV_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")

_lock = threading.Lock()
_outcome: str | None = None


def keep_freed_buffers() -> str:
    """Apply the setting once per process; returns what was done, in words (also logged once)."""
    global _outcome
    with _lock:
        if _outcome is None:
            _outcome = _apply()
            log.info("KV transfer allocator: %s", _outcome)
        return _outcome


def _apply() -> str:
    preset = [key for key in _ENV_KEYS if key in os.environ]
    if preset:
        return f"left as configured by the environment ({', '.join(preset)})"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it, and only glibc's mallopt takes these
    except (OSError, AttributeError, TypeError):
        return "unchanged (not glibc)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = [mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD), mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
               mallopt(_M_TOP_PAD, TOP_PAD)]
    if not all(applied):
        return f"glibc refused some mallopt settings ({applied}); freed buffers may go back to the kernel"
    return (f"freed buffers up to {MMAP_THRESHOLD >> 20} MiB stay in the heap (mmap threshold), "
            f"trim threshold {TRIM_THRESHOLD >> 20} MiB, top pad {TOP_PAD >> 20} MiB")
