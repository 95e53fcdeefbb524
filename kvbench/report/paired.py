"""Paired differences against a baseline policy (``kvbench-report --paired POLICY``).

Every policy of a sweep runs on the same examples, so a comparison of two policies should resample examples, not
cells: the interval of the per-example difference (a paired bootstrap) is much narrower than two independent
intervals whenever examples differ in difficulty more than the policies differ in effect, which is the usual
case on small samples. Only examples both policies finished are paired.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from kvbench.report.aggregate import LEVEL, N_BOOT, bootstrap, context_codes, shares_context
from kvbench.report.style import display_name, is_baseline, lower_is_better, sort_policies
from kvbench.report.tables import BLOCK, markdown_table
from kvbench.results.schema import BUDGET, EXAMPLE_ID, MODEL, POLICY, STAGE, STATUS, STATUS_OK, TASK

PAIRED_COLUMNS = [*BLOCK, BUDGET, POLICY, "baseline", "diff", "ci_low", "ci_high", "n", "better", "worse"]


def baseline_rows(block: pd.DataFrame, everything: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """The baseline's rows for one block; the full cache ignores budget and stage, so any of its rows serve."""
    rows = block[block[POLICY].eq(baseline)]
    if rows.empty and is_baseline(baseline):
        model, task = block[MODEL].iat[0], block[TASK].iat[0]
        full = everything[everything[POLICY].eq(baseline) & everything[MODEL].eq(model) & everything[TASK].eq(task)]
        rows = full[full[STAGE].eq(full[STAGE].iat[0])] if len(full) else full
    return rows


def paired_differences(
    rows: pd.DataFrame,
    column: str,
    metric_names: Mapping[str, str],
    baseline: str,
    n_boot: int = N_BOOT,
    seed: int = 0,
) -> pd.DataFrame:
    """One row per model, task, stage, budget and policy: the mean over paired examples of policy − baseline in
    ``column``, its percentile-bootstrap interval, the number of pairs, and on how many examples the policy did
    better and worse (by the direction of each task's metric, ``metric_names``: task → metric)."""
    ok = rows[rows[STATUS].eq(STATUS_OK)] if STATUS in rows else rows
    ok = ok.assign(_value=pd.to_numeric(ok[column], errors="coerce")).dropna(subset=["_value"])
    records = []
    for key, block in ok.groupby([*BLOCK, BUDGET], sort=False):
        base = baseline_rows(block, ok, baseline).drop_duplicates(EXAMPLE_ID).set_index(EXAMPLE_ID)["_value"]
        if base.empty:
            continue
        lower = lower_is_better(metric_names.get(str(key[1]), column))
        for policy, cells in block[block[POLICY].ne(baseline)].groupby(POLICY, sort=False):
            values = cells.drop_duplicates(EXAMPLE_ID).set_index(EXAMPLE_ID)["_value"]
            shared = values.index.intersection(base.index)
            diff = (values[shared] - base[shared]).to_numpy(dtype=float)
            if not len(diff):
                continue
            rng = np.random.default_rng([seed, zlib.crc32("\x1f".join(map(str, (*key, policy))).encode())])
            clusters = context_codes(shared, shares_context(cells) or shares_context(block))
            mean, low, high, count = bootstrap(diff[:, None], rng, n_boot, clusters=clusters)
            gain = -diff if lower else diff
            records.append(
                dict(zip([*BLOCK, BUDGET], key))
                | {
                    POLICY: policy,
                    "baseline": baseline,
                    "diff": mean[0],
                    "ci_low": low[0],
                    "ci_high": high[0],
                    "n": int(count[0]),
                    "better": int((gain > 0).sum()),
                    "worse": int((gain < 0).sum()),
                    "budget_kind": block["budget_kind"].iat[0],
                    "budget_value": block["budget_value"].iat[0],
                }
            )
    return pd.DataFrame.from_records(records, columns=[*PAIRED_COLUMNS, "budget_kind", "budget_value"])


def stratified_bootstrap(
    strata: Sequence[np.ndarray],
    rng: np.random.Generator,
    n_boot: int = N_BOOT,
    level: float = LEVEL,
    weights: Sequence[float] | None = None,
    clusters: Sequence[np.ndarray | None] | None = None,
) -> tuple[float, float, float]:
    """The mean over strata of each stratum's mean (tasks weigh alike, whatever their number of examples; or as
    ``weights`` say, relative) and its percentile-bootstrap interval, resampling examples within each stratum (or
    the contexts of ``clusters``, each with all its rows, as ``bootstrap``): the interval of a benchmark average
    whose tasks were all run, where only the examples are a sample. Widened to include the mean, as
    ``bootstrap``."""
    scale = [1.0] * len(strata) if weights is None else [float(w) for w in weights]
    codes = [None] * len(strata) if clusters is None else clusters
    means = np.zeros(n_boot)
    for values, weight, own in zip(strata, scale, codes):
        own = np.arange(len(values)) if own is None else own
        sums = np.bincount(own, weights=np.asarray(values, dtype=float))
        sizes = np.bincount(own).astype(float)
        picks = rng.integers(0, len(sums), size=(n_boot, len(sums)))
        means += weight * sums[picks].sum(axis=1) / sizes[picks].sum(axis=1)
    means /= sum(scale)
    mean = float(np.average([np.mean(values) for values in strata], weights=weights))
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return mean, min(float(low), mean), max(float(high), mean)


def _signed(value: float) -> str:
    """Three decimals with a sign: a difference near zero reads as one, not in scientific notation."""
    return f"{value:+.3f}"


def paired_markdown(paired: pd.DataFrame) -> str:
    """One table per model, task and stage: policies × budgets, each cell ``diff [low, high] better/worse of n``."""
    parts = []
    for (model, task, stage), block in paired.groupby(BLOCK, sort=True):
        order = block.sort_values(["budget_kind", "budget_value"])[BUDGET].drop_duplicates().tolist()
        cells = block.assign(
            text=[
                f"{_signed(r.diff)} [{_signed(r.ci_low)}, {_signed(r.ci_high)}] {r.better}/{r.worse} of {r.n}"
                for r in block.itertuples()
            ]
        )
        wide = cells.pivot_table(index=POLICY, columns=BUDGET, values="text", aggfunc="first")
        wide = wide.reindex(index=sort_policies(block[POLICY]), columns=order).fillna("–")
        wide = wide.rename(index=display_name).reset_index()
        heading = f"**{model} · {task} · {stage}** − {display_name(block['baseline'].iat[0])}"
        parts.append(f"{heading}\n\n{markdown_table(wide)}")
    return "\n\n".join(parts)
