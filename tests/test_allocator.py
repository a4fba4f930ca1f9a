"""vespo.allocator fixes glibc's mmap threshold, so a freed large tensor goes back to the system."""

import sys

import pytest
import torch

from vespo.allocator import return_freed_memory


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc on Linux")
def test_a_freed_large_tensor_leaves_the_process():
    assert return_freed_memory() is True
    before = _rss_mb()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert _rss_mb() > before + 48
    del block
    assert _rss_mb() < before + 16
