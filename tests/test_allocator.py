"""vespo.allocator fixes glibc's mmap threshold, so a freed large tensor goes back to the system.

Each check runs in a fresh interpreter, as the library is used (``return_freed_memory`` once at a
process's start): a long-lived test worker's heap may already hold a freed chunk that malloc reuses
without touching new pages. The process first frees a mapped 24 MiB block, which raises glibc's
dynamic threshold past 20 MiB; a 20 MiB tensor then comes from the heap and stays resident after it
is freed, unless the threshold was fixed (the control shows the first half, so the check can fail).
"""

import subprocess
import sys

import pytest

CHECK = r"""
import sys
import torch
from vespo.allocator import return_freed_memory

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

warm = torch.ones(24 * 2**20 // 4)
del warm  # a freed mapped block: glibc raises its threshold to 24 MiB
if sys.argv[1] == "fixed":
    assert return_freed_memory() is True
before = rss_mb()
block = torch.ones(20 * 2**20 // 4)  # 20 MiB, touched
grown = rss_mb() - before
del block
left = rss_mb() - before
print(f"{grown:.1f} {left:.1f}")
"""


def _grown_and_left(mode: str) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", CHECK, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    grown, left = map(float, out.stdout.split())
    return grown, left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc on Linux")
def test_a_freed_large_tensor_leaves_the_process():
    grown, left = _grown_and_left("fixed")
    assert grown > 16  # the block was resident
    assert left < 4  # and freeing it gave it back


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc on Linux")
def test_without_the_fix_the_same_block_stays_in_the_heap():
    grown, left = _grown_and_left("default")
    assert grown > 16
    assert left > 16
