"""Timers and memory probes that mean the same thing on CPU and CUDA."""
from __future__ import annotations

import resource
import sys
import time

import numpy as np
import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """A wall-clock reading taken after the device has finished its queued work."""
    synchronize(device)
    return time.perf_counter()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Device peak since the last reset on CUDA; the process's peak resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "process_peak_rss"


def latency_summary(seconds: list[float]) -> dict[str, float | None]:
    """Mean, p50 and p95 per-token decode latency in ms, and tokens/s."""
    if not seconds:
        return {"decode_ms_mean": None, "decode_ms_p50": None, "decode_ms_p95": None, "decode_tokens_per_s": None}
    ms = np.asarray(seconds) * 1e3
    return {
        "decode_ms_mean": float(ms.mean()),
        "decode_ms_p50": float(np.percentile(ms, 50)),
        "decode_ms_p95": float(np.percentile(ms, 95)),
        "decode_tokens_per_s": float(len(seconds) / np.sum(seconds)),
    }
