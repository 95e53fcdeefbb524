"""A cell of ``experiment=capacity``: the largest batch under the memory cap, found by real runs of the task's
prompts (:mod:`kvbench.capacity`), a row per probed batch size. A resumed cell reuses the probes it has."""

from __future__ import annotations

import logging
from typing import Any

from kvbench.capacity import capacity_rows
from kvbench.config import RunSpec
from kvbench.engine.engine import Request
from kvbench.results.provenance import provenance
from kvbench.results.schema import (
    CAPACITY_BATCH,
    DECODE_TOKENS_PER_S,
    KIND,
    KIND_CAPACITY,
    CapacityProbe,
    CapacitySummary,
    CellIdentity,
    Row,
)
from kvbench.results.writer import CellResults
from kvbench.runner import model_cache
from kvbench.runner.passes import example_settings
from kvbench.runner.prompts import render_all
from kvbench.tasks.base import Task

log = logging.getLogger("kvbench")
DEFAULT_MAX_BATCH = 1024


def fill_capacity_cell(results: CellResults, task: Task, spec: RunSpec, cell: CellIdentity) -> dict[str, Any]:
    """Probe batch sizes (doubling, then bisection) until the largest that fits is known; returns the summary."""
    cap = float(spec.capacity["memory_gib"])
    limit = int(spec.capacity.get("max_batch") or DEFAULT_MAX_BATCH)
    done = {int(r[CAPACITY_BATCH]): r for r in results.rows() if r.get(KIND) == KIND_CAPACITY}
    examples = task.examples()
    rendered = render_all(task, examples, spec)
    lm = model_cache.get_model(spec.model)
    origin = provenance(lm.device, lm.dtype)
    requests = [
        Request(rendered[ex.id].input_ids, rendered[ex.id].suffix_ids, example_settings(task, spec, ex))
        for ex in examples
    ]
    eos = lm.model.generation_config.eos_token_id
    lm.model.generation_config.eos_token_id = None  # every probe decodes its full length: comparable steps
    try:
        best, probes = capacity_rows(
            lm.model, requests, spec.policy, spec.budget, spec.stage, cap, limit, spec.stride, done
        )
    finally:
        lm.model.generation_config.eos_token_id = eos
    for found in probes:
        probe = CapacityProbe(capacity_memory_gib=cap, **found)
        results.append(Row(cell, f"batch={probe.batch}", KIND_CAPACITY, probe, origin))
    rows = [r for r in results.rows() if r.get(KIND) == KIND_CAPACITY]
    at_best = next((r for r in rows if r[CAPACITY_BATCH] == best), {})
    summary = CapacitySummary(
        cell=cell,
        n_expected=len(rows),
        n_ok=len(rows),
        n_error=0,
        max_batch=best,
        capacity_memory_gib=cap,
        decode_tokens_per_s_at_max_batch=at_best.get(DECODE_TOKENS_PER_S),
    )
    log.info("cell %s: largest batch under %.3g GiB is %d", results.dir, cap, best)
    return results.write_summary(summary)
