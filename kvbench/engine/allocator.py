"""The CPU allocator setting a batch run needs, so that its resident set is its live memory."""

from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LARGE_BLOCK_BYTES = 4 << 20  # a prompt's activations and blocked buffers; not a decode step's temporaries


def map_large_blocks_alone() -> None:
    """glibc: every block of ``LARGE_BLOCK_BYTES`` or more gets a mapping of its own, handed back to the system
    when freed. By default glibc raises that threshold whenever such a block is freed (up to 32 MiB), and from
    then on a prompt's freed working memory (its cache, its activations, the blocked pass's buffers) stays in
    the heap of the thread that used it: a run's resident set held tens of MiB more than its live tensors
    (``docs/perf/batch.md``). Setting the threshold once fixes it for the process; elsewhere nothing to do. At
    glibc's own starting threshold (128 KiB) a decode step's small buffers were mapped afresh every step too, and
    a step at batch 4 measured up to 3 × slower."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES)
        except (OSError, AttributeError):
            pass
