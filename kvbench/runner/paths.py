"""Where a cell's results go: a directory below the sweep that says what the cell is, and that a rerun finds
again.

The directory is the named axes (model, task, policy, stage, budget, batch), each followed by what the cell's
config changes of that name's defaults, and last what it changes of the run's:
``tiny-llama/jsonl/path=a.jsonl/h2o/scope.window=0.75,quantize=int8/prefill/budget=0.5/max_new_tokens=8``. The
defaults are the config Hydra composes from the same model, task and policy choices alone, so every setting that
can change rows, however it was given (command line, sweep, preset), is part of the cell: an ablation sweep gets
a directory per value, and a cell at its named defaults keeps the plain path. A change too long or too odd for a
directory name is shortened and completed by a hash of it.

Left out: the bookkeeping keys (``results_dir``, ``tracking``, ``model.cache_dir``, ...:
``kvbench.results.writer``) and what the model's name stands for (its source and weights). The cell's
``config.yaml`` still pins all but the bookkeeping keys: a rerun whose config differs anywhere else is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from collections.abc import Mapping
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from kvbench.config.phases import composed
from kvbench.config.schema import RunSettings
from kvbench.results.schema import CellIdentity
from kvbench.results.settings import GROUPS, RUN, owner, value_text
from kvbench.results.writer import BOOKKEEPING_KEYS

AXES = ("budget", "stage", "batch_size")  # run settings the directory names by themselves
NAMED_BY = {
    "model": ("name", "source", "embedded", "name_or_path"),  # the model's name stands for its weights
    "task": ("name", "subset"),
    "policy": ("name",),
}
RUN_KEYS = tuple(f.name for f in dataclasses.fields(RunSettings) if f.name not in (*AXES, *BOOKKEEPING_KEYS))
MAX_SEGMENT = 80
_SAFE_KEY = re.compile(r"[A-Za-z0-9_.-]+")
_SAFE_VALUE = re.compile(r"[A-Za-z0-9_.+-]*")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.+=,-]+")


def flat_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every setting of a resolved config that can change its rows, as dotted key -> value."""
    out: dict[str, Any] = {}
    for key in RUN_KEYS:
        if key in config:
            _flatten(config[key], key, out)
    for group in GROUPS:
        for key, value in (config.get(group) or {}).items():
            if key not in NAMED_BY[group] and f"{group}.{key}" not in BOOKKEEPING_KEYS:
                _flatten(value, f"{group}.{key}", out)
    return out


def _flatten(value: Any, key: str, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping) and value:
        for inner, item in value.items():
            _flatten(item, f"{key}.{inner}", out)
    else:
        out[key] = value


def changed_settings(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The settings ``config`` gives otherwise than ``defaults`` or adds to them: in the defaults' order, then
    the added keys sorted, so that one config always gives one directory."""
    mine, base = flat_settings(config), flat_settings(defaults)
    changed = {key: mine[key] for key in base if key in mine and mine[key] != base[key]}
    changed.update({key: mine[key] for key in sorted(set(mine) - set(base))})
    return changed


def segment(settings: Mapping[str, Any]) -> str:
    """``key=value,key=value``; past ``MAX_SEGMENT`` characters, or with characters a directory name should not
    hold, a readable prefix and a hash of the whole."""
    pairs = [(key, value_text(value)) for key, value in settings.items()]
    text = ",".join(f"{key}={value}" for key, value in pairs)
    if len(text) <= MAX_SEGMENT and all(_SAFE_KEY.fullmatch(k) and _SAFE_VALUE.fullmatch(v) for k, v in pairs):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"{_UNSAFE.sub('_', text)[: MAX_SEGMENT - len(digest) - 1]}~{digest}"


def cell_path(config: Mapping[str, Any], settings: Mapping[str, Any]) -> str:
    """A cell's directory below the sweep, from its resolved config and its ``changed_settings``. The full cache
    ignores the budget, so all its budgets share one cell; a batched cell (its timings are a batch's) has a
    directory of its own."""
    by_group: dict[str, dict[str, Any]] = {group: {} for group in (*GROUPS, RUN)}
    for key, value in settings.items():
        group, inner = owner(key)
        by_group[group][inner] = value
    model, task, policy = (config[group] for group in GROUPS)
    subset = task.get("subset")
    task_id = f"{task['name']}-{subset}" if subset not in (None, "") else task["name"]
    budget = "full" if policy["name"] == "full" else config["budget"]
    batch = config.get("batch_size", 1)
    parts = [
        model["name"],
        segment(by_group["model"]),
        task_id,
        segment(by_group["task"]),
        policy["name"],
        segment(by_group["policy"]),
        config["stage"],
        f"budget={budget}",
        f"batch={batch}" if batch not in (1, None) else "",
        segment(by_group[RUN]),
    ]
    return "/".join(str(part) for part in parts if part)


@functools.cache
def named_defaults(config_name: str, choices: tuple[str, ...], searchpath: tuple[str, ...] = ()) -> dict[str, Any]:
    """The config Hydra composes from these group choices (``policy=h2o``, ...) and nothing else (no preset, no
    other override), finding config files where the run found them (``hydra.searchpath``)."""
    return composed(config_name, choices, searchpath)


def hydra_settings(config: Mapping[str, Any], hydra: Any) -> dict[str, Any]:
    """``changed_settings`` of a resolved config against the named defaults of the choices Hydra made for it
    (``hydra`` is Hydra's own node of the run). Needs Hydra initialised, as it is inside ``kvbench-run``."""
    choices = tuple(f"{group}={hydra.runtime.choices[group]}" for group in GROUPS)
    searchpath = tuple(str(path) for path in hydra.searchpath)
    return changed_settings(config, named_defaults(str(hydra.job.config_name), choices, searchpath))


def job_settings(cfg: DictConfig) -> dict[str, Any]:
    """The running job's ``hydra_settings`` (what its rows record)."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(plain, dict)
    return hydra_settings({str(k): v for k, v in plain.items()}, HydraConfig.get())


def _cell_dir(*, _root_: DictConfig) -> str:
    """``${kvbench_cell:}`` in configs/config.yaml: the directory of the cell Hydra is about to run."""
    job = OmegaConf.masked_copy(_root_, [str(key) for key in _root_ if key != "hydra"])
    plain = OmegaConf.to_container(job, resolve=True)
    assert isinstance(plain, dict)
    config = {str(k): v for k, v in plain.items()}
    return cell_path(config, hydra_settings(config, _root_.hydra))


# Known to OmegaConf as soon as the runner is imported: Hydra resolves the cell's directory before any cell runs.
OmegaConf.register_new_resolver("kvbench_cell", _cell_dir, replace=True)


def run_name(cell: CellIdentity) -> str:
    """A cell's name in a tracker's list of runs."""
    changed = ",".join(f"{key}={value_text(value)}" for key, value in cell.settings.items())
    return f"{cell.model}|{cell.task}|{cell.policy}|{cell.stage}|{cell.budget}" + (f"|{changed}" if changed else "")
