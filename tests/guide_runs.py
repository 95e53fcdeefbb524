"""Runs a guide's `kvbench-run` line in this process, as a reader would type it, with the guide's config file on
Hydra's search path (docs/extending.md's worked score and worked task share this)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra

import kvbench.run as runner


def run_guide_line(
    run_line: str, settings: list[str], tmp_path: Path, configs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run_line`` (``kvbench-run ...``) plus ``settings``, results under ``tmp_path/results``."""
    run_args = shlex.split(run_line)
    assert run_args[0] == "kvbench-run"
    argv = [
        *run_args,
        *settings,
        f"results_dir={tmp_path / 'results'}",
        f"hydra.searchpath=[file://{configs}]",
        "hydra/job_logging=none",
        "hydra/hydra_logging=none",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    GlobalHydra.instance().clear()
    try:
        runner.main()
    except SystemExit as done:
        assert done.code in (0, None)
    finally:
        GlobalHydra.instance().clear()
