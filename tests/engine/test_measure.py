"""Memory probes: a run's CPU peak starts with the run, not with the process (a sweep runs its cells in one)."""

from __future__ import annotations

import sys

import psutil
import pytest
import torch

from kvbench.engine import measure

CPU = torch.device("cpu")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux restarts a process's peak resident set")
def test_a_runs_cpu_peak_is_not_an_earlier_runs():
    """512 MiB made resident and freed before the reset do not count in the peak after it."""
    big = torch.ones(2**27)  # 512 MiB, every page written
    resident = psutil.Process().memory_info().rss
    del big
    measure.trim_freed_memory()
    measure.reset_peak(CPU)
    peak, kind = measure.peak_memory_bytes(CPU)
    assert kind == "peak_rss"
    assert peak <= resident - 400 * 2**20
    again = torch.ones(2**26)  # 256 MiB: the peak after the reset sees it
    assert measure.peak_memory_bytes(CPU)[0] >= peak + 200 * 2**20
    del again
