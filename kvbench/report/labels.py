"""Names that keep cells apart: ``h2o (window=0.75, quantize=int8)``, ``jsonl (path=b.jsonl)``.

Each row records what its cell's config changes of the named model's, task's and policy's defaults
(``settings``, see kvbench.results.settings). The report names every model, task and policy by its own
changes, leaving out those every cell shares (``shared_settings``, stated once), so that two cells that differ
only in a hyperparameter are never averaged together and a reader sees what sets them apart. The run's settings
(``max_new_tokens``, ``sampling``, ...) and a batch size go with the policy: the legend is where a line is named.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from kvbench.results.schema import BATCH_SIZE, MODEL, POLICY, SETTINGS, TASK
from kvbench.results.settings import owner, value_text

Entry = tuple[str, str]  # (dotted key, value as text)
COLUMN_OF = {"model": MODEL, "task": TASK, "policy": POLICY}


# How a paper names each named policy (configs/policy/<name>.yaml): one display name per policy in every figure,
# table and legend; a policy not listed is named by its score's declared label, else by its config name.
DISPLAY_NAMES = {
    "full": "Full cache",
    "window": "Window",
    "streamingllm": "StreamingLLM",
    "random": "Random",
    "h2o": "H2O",
    "scissorhands": "Scissorhands",
    "tova": "TOVA",
    "roco": "RoCo",
    "snapkv": "SnapKV",
    "knorm": "K-norm",
    "vatp": "VATP",
    "pyramidkv": "PyramidKV",
    "adakv": "Ada-KV",
    "mean_window": "Mean window",
    "accumulated_robust": "Accumulated (robust)",
    "keydiff": "KeyDiff",
    "cur": "CurDKV",
    "lagkv": "LagKV",
    "leverage": "Leverage",
    "threshold": "Threshold (DMS)",
    "cam": "CaM",
    "rkv": "R-KV",
    "expected_attention": "Expected Attention",
    "criticalkv": "CriticalKV",
    "criticalkv_adakv": "CriticalKV + Ada-KV",
    "chunkkv": "ChunkKV",
    "noncausal_attn": "Non-causal attention",
    "compactor": "Compactor",
    "cap": "CAPKV",
}


def labelled(name: str, parts: Iterable[str]) -> str:
    """``name (part, part)``, or the name alone."""
    shown = ", ".join(parts)
    return f"{name} ({shown})" if shown else name


def base_name(label: str) -> str:
    """The name a label starts with (``h2o (window=0.75)`` -> ``h2o``)."""
    return label.split(" (", 1)[0]


def entries(settings: Any) -> tuple[Entry, ...]:
    """A row's settings as (key, text) pairs; rows from before settings were recorded have none."""
    if not isinstance(settings, Mapping):
        return ()
    return tuple((str(key), value_text(value)) for key, value in settings.items())


def _short_keys(keys: Iterable[str]) -> dict[str, str]:
    """Each key as its last part where no other key ends the same, so that labels stay short and distinct."""
    keys = set(keys)
    last = [key.rsplit(".", 1)[-1] for key in keys]
    return {key: short if last.count(short) == 1 else key for key, short in zip(keys, last)}


def shared_settings(rows: pd.DataFrame) -> list[Entry]:
    """The settings every row that records them has (in the first one's order): said once, not in every label.
    Rows written before settings were recorded are named as they always were, so a rerun of such a sweep (its
    shared settings now recorded) names its cells as before."""
    if SETTINGS not in rows:
        return []
    kinds = list(dict.fromkeys(entries(s) for s in rows[SETTINGS] if isinstance(s, Mapping)))
    if not kinds:
        return []
    common = set(kinds[0]).intersection(*kinds[1:])
    return [entry for entry in kinds[0] if entry in common]


def _by_column(own: tuple[Entry, ...], shared: set[Entry]) -> dict[str, list[Entry]]:
    """A cell's changes that not every cell shares, under the column that names them (the run's: the policy)."""
    out: dict[str, list[Entry]] = {column: [] for column in COLUMN_OF.values()}
    for key, value in own:
        if (key, value) not in shared:
            group, inner = owner(key)
            out[COLUMN_OF.get(group, POLICY)].append((inner, value))
    return out


def label_cells(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with the model, task and policy columns naming what sets each cell apart (and a batch size above
    one with the policy: a batch's timings are not one sequence's)."""
    if rows.empty:
        return rows
    shared = set(shared_settings(rows))
    settings = rows[SETTINGS].map(entries) if SETTINGS in rows else pd.Series([()] * len(rows), index=rows.index)
    sizes = rows[BATCH_SIZE] if BATCH_SIZE in rows else pd.Series(1, index=rows.index)
    batch = pd.to_numeric(sizes, errors="coerce").fillna(1).astype(int)
    cells: dict[tuple[tuple[Entry, ...], int], list[Any]] = {}
    for index, cell in zip(rows.index, zip(settings, batch)):
        cells.setdefault(cell, []).append(index)
    changes = {own: _by_column(own, shared) for own, _ in cells}
    short = {
        column: _short_keys(key for by_column in changes.values() for key, _ in by_column[column])
        for column in COLUMN_OF.values()
    }
    out = rows.copy()
    for (own, size), index in cells.items():
        for column, changed in changes[own].items():
            parts = [f"{short[column][key]}={value}" for key, value in changed]
            parts += [f"batch {size}"] if column == POLICY and size > 1 else []
            if parts:
                out.loc[index, column] = out.loc[index, column].map(lambda name, p=parts: labelled(name, p))
    return out
