"""``kvbench-run``: compose the config with Hydra and hand the cell to the runner (:mod:`kvbench.runner`).

Alone (``kvbench-run ...``) a cell that cannot run exits with status 2 and one message; in a sweep (``-m``, any
launcher) the message goes to ``<cell>/error.txt`` and the sweep goes on (the table at the end of the sweep lists
such cells).
"""

from __future__ import annotations

import logging
import sys
import traceback
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from kvbench.config import ConfigError
from kvbench.results.schema import MEAN_PREFIX, SCORE
from kvbench.results.writer import CellBusy, CellConflict, write_error
from kvbench.runner.cell import run_cell
from kvbench.runner.paths import job_settings

log = logging.getLogger("kvbench")
# configs/hydra/launcher/{joblib,submitit_local,submitit_slurm}.yaml are complete launcher configs named
# like the plugins' own schemas; Hydra merges the two and warns about it in every process.
warnings.filterwarnings("ignore", message=r"[\s\S]*is validated against ConfigStore schema with the same name")
CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    """One cell, as Hydra composed it."""
    hc = HydraConfig.get()
    cell_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    try:
        summary = run_cell(cfg, cell_dir, str(cfg.sweep_name), settings=job_settings(cfg), skip_busy=multirun)
        log.info("done: %s", {k: v for k, v in summary.items() if not k.startswith(MEAN_PREFIX) or SCORE in k})
    except (ConfigError, CellBusy, CellConflict) as err:
        print(f"kvbench: {err}", file=sys.stderr)
        if not multirun:
            sys.exit(2)
        write_error(cell_dir, f"kvbench: {err}")
    except Exception:
        if not multirun:
            raise
        log.error("cell %s failed:\n%s", cell_dir, traceback.format_exc())
        write_error(cell_dir, traceback.format_exc())


if __name__ == "__main__":
    main()
