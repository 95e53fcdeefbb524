"""Running ``kvbench-run -m`` inside the test process (basic launcher), for tests of whole sweeps."""

from __future__ import annotations

import sys

import pytest
from hydra.core.global_hydra import GlobalHydra

import kvbench.run as entry


@pytest.fixture
def sweep_in_process(tmp_path, monkeypatch, capsys):
    """Run ``kvbench-run -m ARGS`` in this process (basic launcher); returns (exit status, stdout, stderr)."""

    def run(*args: str, sweep_name: str = "p") -> tuple[int, str, str]:
        GlobalHydra.instance().clear()
        quiet = ["hydra/job_logging=none", "hydra/hydra_logging=none"]
        argv = ["kvbench-run", "-m", *args, f"results_dir={tmp_path}", f"sweep_name={sweep_name}", *quiet]
        monkeypatch.setattr(sys, "argv", argv)
        code = 0
        try:
            entry.main()
        except SystemExit as done:
            code = done.code
        finally:
            GlobalHydra.instance().clear()
        out = capsys.readouterr()
        return code, out.out, out.err

    return run
