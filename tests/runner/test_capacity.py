"""The capacity experiment: the search for the largest batch, real probes through a Hydra cell, the report."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import CONFIG_DIR, REPO
from hydra import compose, initialize_config_dir

import kvbench.engine.allocator as allocator
from kvbench.capacity import Probe, largest_batch
from kvbench.config import ConfigError
from kvbench.engine.engine import Engine, EngineSettings
from kvbench.policies.registry import build_policy
from kvbench.report.build import build_report
from kvbench.results.writer import read_rows
from kvbench.runner.cell import run_cell


def synthetic(threshold: int):
    return lambda b: Probe(b, b <= threshold, b * 10, "test", float(b), 1.0, b)


@pytest.mark.parametrize("threshold", [0, 1, 2, 3, 5, 8, 13, 64, 100])
def test_doubling_then_bisection_finds_the_largest_batch_that_fits(threshold):
    best, probes = largest_batch(synthetic(threshold), limit=100)
    assert best == min(threshold, 100)
    tried = [p.batch for p in probes]
    doubling = [b for b in tried if b & (b - 1) == 0]
    assert doubling[: len(doubling)] == [1, 2, 4, 8, 16, 32, 64][: len(doubling)]  # 1, 2, 4, ... first
    assert len(tried) == len(set(tried))  # nothing probed twice
    if 0 < threshold < 100:
        assert best + 1 in tried and not next(p for p in probes if p.batch == best + 1).fits  # the edge was probed


def cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def test_a_capacity_cell_probes_real_batches_and_reports(tmp_path):
    """A cap no run reaches: the search climbs to capacity.max_batch with real runs, a row per probe, and the
    report draws the three capacity figures."""
    base = [
        "model=tiny-llama",
        "task.n=2",
        "task.context_tokens=96",
        "max_new_tokens=4",
        "stage=both",
        "capacity.memory_gib=64",
        "capacity.max_batch=3",
        f"results_dir={tmp_path}",
    ]
    for policy, budget in (("full", "1.0"), ("h2o", "0.25"), ("h2o", "0.5")):
        cell = tmp_path / "capacity" / policy / budget
        summary = run_cell(cfg(base + [f"policy={policy}", f"budget={budget}"]), cell, "capacity")
        assert summary["max_batch"] == 3
        rows = read_rows(cell / "rows.jsonl")
        assert [r["capacity_batch"] for r in rows] == [1, 2, 3] and all(r["fits"] for r in rows)
        assert all(r["decode_tokens_per_s"] > 0 and r["peak_memory_bytes"] >= 0 for r in rows)
        assert summary["decode_tokens_per_s_at_max_batch"] == rows[-1]["decode_tokens_per_s"]
        again = run_cell(cfg(base + [f"policy={policy}", f"budget={budget}"]), cell, "capacity")
        assert again["max_batch"] == 3 and len(read_rows(cell / "rows.jsonl")) == 3  # complete: nothing rerun
    report = build_report([tmp_path / "capacity"], tmp_path / "report").read_text()
    for stem in ("capacity_tokens_per_s_vs_budget", "capacity_max_batch_vs_budget", "capacity_tokens_per_s_vs_batch"):
        assert stem in report
        assert list((tmp_path / "report").glob(f"{stem}_*.pdf"))
    assert "| tiny-llama | retrieval | both | 64 GiB | H2O | 25% | 3 |" in report  # the cap in GiB, the display name


@pytest.mark.parametrize(
    "override, message",
    [
        ("capacity.memory_gib=0", "capacity.memory_gib=0 must be a positive"),
        ("capacity.max_batch=0", "capacity.max_batch=0 must be a positive"),
    ],
)
def test_bad_capacity_settings_are_refused(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        run_cell(cfg(["model=tiny-llama", override]), tmp_path / "c", "t")


RETAINED = """
import sys, psutil, torch
from kvbench.engine.allocator import map_large_blocks_alone
if sys.argv[1] == "mapped":
    map_large_blocks_alone()
rss = psutil.Process().memory_info
for _ in range(2):  # the first free raises glibc's default threshold past the block; the second block stays
    before = rss().rss
    block = torch.ones(6 << 20)  # 24 MiB, written: resident
    del block
print((rss().rss - before) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_large_blocks_leave_the_resident_set():
    """CPU capacity probes measure the resident set: a freed prompt's working memory must leave it. Under
    glibc's default a block freed after the threshold grew stays in the heap (checked, so that the test can
    fail); with every large block mapped alone it goes back to the system."""

    def retained_mib(mode: str) -> int:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", RETAINED, mode], capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    assert retained_mib("default") >= 20
    assert retained_mib("mapped") <= 2


def test_a_cpu_batch_run_maps_large_blocks_alone(monkeypatch, tiny):
    calls = []
    monkeypatch.setattr(allocator, "map_large_blocks_alone", lambda: calls.append(1))
    Engine(tiny.model, None, EngineSettings(build_policy({"name": "full"}), 1.0, "both", 2))
    assert calls == [1]
