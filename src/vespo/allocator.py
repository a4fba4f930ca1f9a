"""Give freed large tensors back to the operating system (glibc's malloc, Linux).

glibc serves an allocation above its mmap threshold with its own mapping, unmapped when freed; below
it, from the heap, which rarely shrinks. The threshold starts at 128 KiB and rises (up to 32 MiB) each
time a mapped block is freed, so after a few steps the tensors of a decode loop (KV caches of a few MB,
re-allocated every token) are carved out of the heap and the freed holes fragment it: measured on
SmolLM2-135M generating 256 held-out answers, the process grew to 15 GB and the system killed the
run; with the threshold fixed at 1 MiB the same evaluation stayed at 1.6 GB. ``vespo`` commands and
the Ray rollout workers call :func:`return_freed_memory` once at start.
"""

from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h); setting it also turns the threshold's rise off
THRESHOLD_BYTES = 1 << 20


def return_freed_memory(threshold: int = THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes; True where it took effect (glibc on Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):  # another C library (musl): nothing to set
        return False
