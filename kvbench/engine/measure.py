"""Timers and memory probes that mean the same thing on CPU and CUDA."""

from __future__ import annotations

import ctypes
import gc
import resource
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
import torch

# Whether the last ``reset_peak`` restarted the kernel's peak resident set of this process.
_RSS_PEAK_RESET = False


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """A wall-clock reading taken after the device has finished its queued work."""
    synchronize(device)
    return time.perf_counter()


def reset_peak(device: torch.device) -> None:
    """Start a run's peak: CUDA's allocator counter, or on Linux the kernel's peak resident set of the process
    (VmHWM, restarted by writing 5 to /proc/self/clear_refs), so that a run does not inherit the peak of an earlier
    one in the same process (a sweep's cells)."""
    global _RSS_PEAK_RESET
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _RSS_PEAK_RESET = True
    except OSError:  # not Linux, or not allowed: the process's peak since it started
        _RSS_PEAK_RESET = False


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Device peak since the last reset on CUDA; on CPU the resident set's peak since ``reset_peak`` where the
    kernel lets it restart ("peak_rss"), else since the process started ("process_peak_rss")."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    if _RSS_PEAK_RESET:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "peak_rss"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "process_peak_rss"


@dataclass(frozen=True)
class Latency:
    """Per-step latency in milliseconds (mean, median, 95th percentile) and steps per second; None without
    steps."""

    mean_ms: float | None = None
    p50_ms: float | None = None
    p95_ms: float | None = None
    per_s: float | None = None


def latency_summary(seconds: list[float]) -> Latency:
    if not seconds:
        return Latency()
    ms = np.asarray(seconds) * 1e3
    return Latency(
        float(ms.mean()),
        float(np.percentile(ms, 50)),
        float(np.percentile(ms, 95)),
        len(seconds) / float(np.sum(seconds)),
    )


def trim_freed_memory(collect: bool = True) -> None:
    """Hand the pages of every freed block back to the system (glibc only; elsewhere nothing to do), after a
    garbage collection unless ``collect`` is False."""
    if collect:
        gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


class PeakMemory:
    """Peak memory above the level at entry: CUDA's allocator counter (``kind`` "cuda_max_allocated"), or on
    CPU the resident set sampled every millisecond after freed pages went back to the system ("cpu_rss")."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "cpu_rss"
        self.base = self.highest = 0
        self.process = psutil.Process() if device.type != "cuda" else None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        trim_freed_memory()
        self.base = self.highest = self._rss()
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done.is_set():
            self.highest = max(self.highest, self._rss())
            time.sleep(0.001)

    def _rss(self) -> int:
        assert self.process is not None, "sampled on CPU only"
        return int(self.process.memory_info().rss)

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
            return
        self.done.set()
        self.thread.join()
        self.peak = self.highest - self.base
