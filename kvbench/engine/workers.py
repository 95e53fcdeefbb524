"""CPU work split across threads, each running its share with one intra-op thread.

A blocked attention pass is a long sequence of products and reductions of a few milliseconds each. Run one
after another, every operation forks the intra-op threads and joins them again, and each block's products
stream through the shared cache; SDPA's own CPU kernel instead gives each thread whole tiles. Splitting the
blocks across as many threads as intra-op parallelism allows, each with its own single-threaded operations
(they release Python's lock), does the same (what it bought: ``docs/perf/prefill.md``). Elsewhere than on CPU
the work runs as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

Item = TypeVar("Item")
Result = TypeVar("Result")
_pools: dict[int, ThreadPoolExecutor] = {}


def split_across_threads(
    work: Callable[[Sequence[Item]], Result], items: Sequence[Item], device: torch.device
) -> list[Result]:
    """``work`` over round-robin shares of ``items``, one share per intra-op thread on CPU (a single share
        elsewhere, or when there is one thread or one item), under the caller's inference and grad modes. The
    caller's intra-op parallelism is restored after."""
    threads = torch.get_num_threads()
    shares = min(threads, len(items)) if device.type == "cpu" else 1
    if shares <= 1:
        return [work(items)]
    pool = _pools.setdefault(shares, ThreadPoolExecutor(max_workers=shares, thread_name_prefix="kvbench-blocks"))

    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()  # thread-local: carried over

    def run(share: Sequence[Item]) -> Result:
        torch.set_num_threads(1)
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return work(share)

    try:
        return list(pool.map(run, [items[i::shares] for i in range(shares)]))
    finally:
        torch.set_num_threads(threads)
