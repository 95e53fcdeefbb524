"""The columns of ``rows.jsonl`` and ``summary.json``: every name spelled here once, with its unit.

A row is one flat JSON object made of the dataclasses below: the cell it belongs to (``CellIdentity``), the
example and its kind, what became of it (``Outcome`` with the engine's ``Measures``, or ``Failure``; a capacity
cell writes a ``CapacityProbe`` per batch size it tried) and where the numbers came from (``Provenance``). Task
metrics are columns ``metric.<name>`` (their names are the tasks'); a summary holds ``mean.<column>`` over the
cell's ok rows. Writers build rows from these classes; readers name columns by the constants at the end, so a
renamed column is renamed here only. Rows written before a column existed still load: ``upgrade`` fills in the
value that was implied when they were written.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

METRIC_PREFIX = "metric."  # metric.<name>: a task's metric, in the task's own unit
MEAN_PREFIX = "mean."  # mean.<column> in a summary: the column's mean over ok rows

STATUS_OK, STATUS_ERROR = "ok", "error"
KIND_EXAMPLE, KIND_CAPACITY = "example", "capacity"


@dataclass(frozen=True)
class CellIdentity:
    """What places a row or summary in the grid; the same on every row of a cell."""

    model: str  # the model config's name
    task: str  # task id: name, or name/subset
    policy: str  # policy name
    budget: float | int  # requested KV budget: fraction (float) of the reference length, or tokens (int); full: 1.0
    stage: str  # when eviction runs: prefill, decode or both
    batch_size: int  # sequences decoded together (1: alone)
    run_dir: str  # the cell's directory, relative to results_dir
    sweep: str  # the sweep's name
    # What the cell's config changes of its named model's, task's and policy's defaults, as dotted key -> value
    # (kvbench.results.settings); empty at the defaults. The report labels cells by it.
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Timings:
    """Wall-clock measurements of one sequence (None where there was nothing to time)."""

    prefill_s: float | None  # seconds to prefill the prompt (context chunks, then the suffix)
    ttft_s: float | None  # seconds from the prefill's start to the first token chosen
    prefill_tokens_per_s: float | None  # prompt tokens per second of prefill
    decode_ms_mean: float | None  # milliseconds per decode step, mean
    decode_ms_p50: float | None  # milliseconds per decode step, median
    decode_ms_p95: float | None  # milliseconds per decode step, 95th percentile
    decode_tokens_per_s: float | None  # this sequence's tokens per second of decode (its share of a batch)
    batch_decode_tokens_per_s: float | None  # the whole batch's tokens per second while this sequence decoded
    decode_batch_mean: float | None  # sequences per decode step, mean (1 when alone)


@dataclass(frozen=True)
class Measures:
    """What the engine measured for one sequence: budget, cache, memory, time, lengths."""

    # The budget in tokens (None: no eviction). Under a decode-time sparsity (Quest) the keys each decode query
    # attends, not held ones: such a policy holds every token (docs/budgets.md).
    budget_tokens: int | None
    # Fraction held, mean over layers: stage=prefill, context tokens kept after prefill / context tokens;
    # otherwise KV tokens held at the end / tokens seen.
    budget_achieved: float
    budget_achieved_per_layer: list[float]  # the same fraction per layer
    kept_tokens: float  # KV tokens held at the end, mean over layers
    # KV tokens held at most, mean over layers: the largest count at the end of any step (after its eviction).
    # The budget the row really held: above budget_tokens by up to policy.interval - 1 (the decode schedule),
    # by the suffix until the first decode eviction, by the prompt in stage=decode.
    peak_kept_tokens: float
    seen_tokens: int  # tokens the cache was fed (the sequence's position at the end)
    kv_resident_bytes: int  # bytes of KV cache held at the end
    kv_resident_peak_bytes: int  # bytes of KV cache held at most
    # Hybrid models: full-attention (budgeted) and sliding-window layers apart; None where a model has none.
    budget_achieved_full: float | None  # fraction, full-attention layers
    budget_achieved_sliding: float | None  # fraction, sliding-window layers
    kv_resident_bytes_full: int | None  # bytes, full-attention layers
    kv_resident_bytes_sliding: int | None  # bytes, sliding-window layers
    kv_capacity_bytes: int  # bytes of the cache's allocated buffers (with a sparsity's page bounds for every slot)
    peak_memory_prefill_bytes: int  # bytes, peak during prefill (see peak_memory_kind)
    peak_memory_bytes: int  # bytes, peak over the run (see peak_memory_kind)
    peak_memory_kind: str  # what the peaks measure: CUDA allocations, or the resident set's peak since the run began
    # (peak_rss; process_peak_rss where the platform cannot restart it: since the process began)
    timings: Timings
    prompt_tokens: int  # tokens of the prompt (context + suffix)
    new_tokens: int  # tokens generated (or teacher-forced)
    stop_reason: str  # why decoding ended: eos, max_new_tokens, a stop string, forced
    # One context asked several questions: true when an earlier row of the context paid for its prefill, so this
    # row's prefill_s, ttft_s and prefill_tokens_per_s count only its question's tokens (and the copy of the
    # compressed context); false on the row that prefilled it and on every row of other tasks.
    prefill_shared: bool = False


@dataclass(frozen=True)
class Outcome:
    """An example that ran: its scores and measurements."""

    status: str = field(default=STATUS_OK, kw_only=True)  # ok
    primary_metric: str  # the name of the task's headline metric
    score: float | None  # the value of the primary metric
    metrics: dict[str, float]  # written as metric.<name> columns
    measures: Measures
    truncated: bool  # the prompt was cut to fit task.max_prompt_tokens
    prediction: str | None = None  # the generated text, post-processed (None: nothing generated)
    references: list[str] | None = None  # the task's reference answers
    fidelity_reference: str | None = None  # file name of the full cache's reference (under .references)
    fidelity_reference_tokens: int | None = None  # tokens of that reference
    scored_tokens: int | None = None  # perplexity: tokens teacher-forced and scored
    # Generation lengths beside the full cache's (docs/results.md). The full cache's come from its reference for
    # the same prompt and seeds (runner/fidelity): None where the run has none (fidelity off and none stored).
    new_tokens_mean: float | None = None  # tokens generated, mean over the samples (one sample: new_tokens)
    full_new_tokens: float | None = None  # tokens the full cache generated, mean over the samples
    kept_of_full: float | None = None  # budget_tokens / (prompt_tokens + full_new_tokens); None without a budget
    # sampling.n_samples > 1: score and metrics are means over the samples (plus metric.pass@1, metric.pass@k with
    # k = n_samples); prediction and the engine's measures are sample 0's; the lists hold every sample, in seed
    # order (seed, seed + 1, ...). None with one sample.
    n_samples: int = 1  # samples drawn for the prompt
    sample_predictions: list[str] | None = None  # each sample's post-processed text
    sample_scores: list[float | None] | None = None  # each sample's primary metric
    sample_new_tokens: list[int] | None = None  # each sample's generated tokens
    sample_full_new_tokens: list[int | None] | None = None  # the full cache's tokens for each sample's seed


@dataclass(frozen=True)
class Failure:
    """An example that failed; the rest of its cell goes on."""

    status: str = field(default=STATUS_ERROR, kw_only=True)  # error
    error: str  # exception type and message
    traceback: str  # the last frames


@dataclass
class CapacityProbe:
    """One batch size a capacity cell tried (``experiment=capacity``); fields as kvbench.capacity.Probe."""

    status: str = field(default=STATUS_OK, kw_only=True)  # ok: the probe ran (fits says whether it fit)
    batch: int  # sequences decoded together
    fits: bool  # the run stayed within the memory cap
    peak_memory_bytes: int  # bytes, peak (see memory_kind)
    memory_kind: str  # CUDA allocations or the process's resident set above its level before the run
    decode_tokens_per_s: float | None  # the batch's tokens per second while full
    decode_step_ms: float | None  # milliseconds per decode step while full, median
    kv_resident_bytes: int | None  # bytes of KV cache held at most, summed over the batch
    error: str | None  # why the probe failed (out of memory)
    capacity_memory_gib: float  # the cap, GiB
    capacity_batch: int = field(init=False)  # = batch, the column the report reads

    def __post_init__(self) -> None:
        self.capacity_batch = self.batch


@dataclass(frozen=True)
class Provenance:
    """Where a number came from."""

    git_sha: str  # kvbench's commit, -dirty with uncommitted changes
    versions: dict[str, str]  # python and package versions
    device: str  # the device's name (CPU: architecture and threads)
    dtype: str  # the model's dtype
    attn_kernel: str  # the attention implementation


@dataclass(frozen=True)
class Row:
    """One line of rows.jsonl."""

    cell: CellIdentity
    example_id: str  # the task's example id (shared context: <example>/<question>; capacity: batch=<n>)
    kind: str  # example or capacity
    result: Outcome | Failure | CapacityProbe
    provenance: Provenance

    def to_json(self) -> dict[str, Any]:
        return flatten(self)


@dataclass(frozen=True)
class Summary:
    """summary.json of an example cell, written when every example has a row."""

    cell: CellIdentity
    primary_metric: str | None
    n_expected: int  # rows the task gives: one per example, or per question of a shared context
    n_ok: int  # rows with status ok
    n_error: int  # rows with status error
    means: dict[str, float]  # written as mean.<column>

    def to_json(self) -> dict[str, Any]:
        return flatten(self)


@dataclass(frozen=True)
class CapacitySummary:
    """summary.json of a capacity cell."""

    cell: CellIdentity
    n_expected: int  # probes run
    n_ok: int
    n_error: int
    max_batch: int  # the largest batch that fit (0: none)
    capacity_memory_gib: float  # the cap, GiB
    decode_tokens_per_s_at_max_batch: float | None  # the batch's decode tokens per second at max_batch

    def to_json(self) -> dict[str, Any]:
        return flatten(self)


def flatten(record: Any) -> dict[str, Any]:
    """A dataclass as one flat JSON object: nested dataclasses inlined, ``metrics`` and ``means`` prefixed."""
    out: dict[str, Any] = {}
    for f in fields(record):
        value = getattr(record, f.name)
        if is_dataclass(value):
            out.update(flatten(value))
        elif f.name == "metrics":
            out.update({metric_column(k): v for k, v in value.items()})
        elif f.name == "means":
            out.update({mean_column(k): v for k, v in value.items()})
        else:
            out[f.name] = value
    return out


def metric_column(name: str) -> str:
    return METRIC_PREFIX + name


def mean_column(column: str) -> str:
    return MEAN_PREFIX + column


# ---------------------------------------------------------------- names for readers

MODEL, TASK, POLICY, BUDGET, STAGE = "model", "task", "policy", "budget", "stage"
CELL = [MODEL, TASK, STAGE, POLICY, BUDGET]  # what makes a point of a figure (and a cell, less the batch size)
BATCH_SIZE, SETTINGS = "batch_size", "settings"
EXAMPLE_ID, KIND, STATUS, ERROR = "example_id", "kind", "status", "error"
PRIMARY_METRIC, SCORE, PREDICTION = "primary_metric", "score", "prediction"
BUDGET_ACHIEVED, BUDGET_ACHIEVED_FULL = "budget_achieved", "budget_achieved_full"
KV_RESIDENT_BYTES = "kv_resident_bytes"
KV_RESIDENT_BYTES_FULL, KV_RESIDENT_BYTES_SLIDING = "kv_resident_bytes_full", "kv_resident_bytes_sliding"
PEAK_MEMORY_BYTES = "peak_memory_bytes"
TTFT_S, DECODE_MS_MEAN, DECODE_TOKENS_PER_S = "ttft_s", "decode_ms_mean", "decode_tokens_per_s"
FITS, CAPACITY_BATCH, CAPACITY_MEMORY_GIB = "fits", "capacity_batch", "capacity_memory_gib"
N_OK, N_ERROR, MAX_BATCH = "n_ok", "n_error", "max_batch"
SKIPPED = "skipped"  # not written: run_cell's answer for a cell another process is writing

# Fields that hold other records (inlined by ``flatten``) rather than a column.
_PARTS: dict[str, tuple[type, ...]] = {
    "cell": (CellIdentity,),
    "timings": (Timings,),
    "measures": (Measures,),
    "result": (Outcome, Failure, CapacityProbe),
    "provenance": (Provenance,),
}


def _leaves(record_type: type) -> list[str]:
    out: list[str] = []
    for f in fields(record_type):
        names = [c for part in _PARTS[f.name] for c in _leaves(part)] if f.name in _PARTS else [f.name]
        out += [n for n in names if n not in out and n not in ("metrics", "means")]
    return out


# Every fixed column a row or summary can have (besides metric.<name> and mean.<column>).
COLUMNS = frozenset(_leaves(Row) + _leaves(Summary) + _leaves(CapacitySummary))


def upgrade(record: dict[str, Any]) -> dict[str, Any]:
    """A row as this version writes it. Rows from before batching have no batch size (they ran alone) and rows
    from before capacity cells no kind (they were examples). Rows from before ``settings`` stay without: what
    their cells changed of the defaults was not recorded (``config.yaml`` beside them has it)."""
    out = dict(record)
    out.setdefault(KIND, KIND_CAPACITY if CAPACITY_BATCH in out else KIND_EXAMPLE)
    out.setdefault(BATCH_SIZE, 1)
    return out
