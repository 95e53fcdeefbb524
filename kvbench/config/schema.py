"""The run config's schema: every setting's type, default and accepted values, stated once.

Hydra composes the YAML files in configs/ over these defaults (see ``store``); ``read`` then types the
composed config against these dataclasses. ``expect`` says what a setting accepts (the message of a value of
the wrong type); ``check`` refuses a well-typed value out of range with the words that follow ``key=value``.
Rules that span several settings are in ``validate``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from kvbench.budget import budget_problem
from kvbench.stages import Choice, Stage

Check = Callable[[Any], str | None]


class Positions(Choice):
    absolute = "absolute"  # kept keys keep their true RoPE rotation
    reindex = "reindex"  # StreamingLLM: positions within the cache


class SlidingLayers(Choice):
    window = "window"  # hybrid models' sliding layers hold their window; the budget is the full layers'
    evict = "evict"  # the policy evicts there too, to at most the window


class Source(Choice):
    embedded = "embedded"  # a GGUF shipped in a PyPI package, converted once
    pretrained = "pretrained"  # a hub id or a local directory
    tiny = "tiny"  # a small random Llama for tests


class Dtype(Choice):
    auto = "auto"  # bfloat16 on CUDA, float32 on CPU
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


class WandbMode(Choice):
    online = "online"
    offline = "offline"
    disabled = "disabled"


def setting(default: Any = MISSING, *, expect: str, check: Check | None = None, factory: Any = None) -> Any:
    """A dataclass field with what it accepts (for messages) and an optional range check."""
    metadata = {"expect": expect, "check": check}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def at_least(low: float, expect: str, *, inclusive: bool = True) -> Check:
    """A check that refuses values below ``low`` (or at it, when not ``inclusive``); None always passes."""

    def check(value: Any) -> str | None:
        bad = value is not None and (value < low if inclusive else value <= low)
        return f"must be {expect}" if bad else None

    return check


def device_problem(device: str) -> str | None:
    """Device names torch understands here; whether CUDA is present is checked in ``validate``."""
    kind, _, index = device.partition(":")
    if device in ("auto", "cpu", "mps", "cuda") or (kind == "cuda" and index.isdigit()):
        return None
    return "is unknown; choose auto, cpu, cuda, cuda:N or mps"


def quantize_problem(name: str) -> str | None:
    """``none`` or a registered quantiser (kvbench.policies.quantize), so a new one needs no edit here."""
    from kvbench.policies.quantize import QUANTIZERS  # not at import: it pulls in torch

    return None if name == "none" or name in QUANTIZERS else f"is unknown; choose one of none, {QUANTIZERS.choices()}"


def merge_problem(spec: Any) -> str | None:
    """false, true, or a merge kind of kvbench.policies.registry (its options are checked with the policy)."""
    from kvbench.policies.merge import MERGES
    from kvbench.policies.registry import MERGE_CHOICES, merge_kind  # not at import: it pulls in torch

    kind = merge_kind(spec)[0]
    return None if kind is None or (isinstance(kind, str) and kind in MERGES) else f"must be {MERGE_CHOICES}"


POSITIVE = "a positive integer"
PHASE_POLICY = "the name of a policy in configs/policy/ (or null: the run's policy)"
INTERVAL = "a positive integer (decode steps from one eviction to the next; 1: every step)"


@dataclass
class ModelConfig:
    name: str = setting(expect="a name for the model (it names the result directories)")
    source: Source = setting(Source.embedded, expect="a model source")
    embedded: str | None = setting(None, expect="the name of an embedded model package (smollm2, gemma3-270m)")
    name_or_path: str | None = setting(None, expect="a hub id or a local model directory")
    dtype: Dtype = setting(Dtype.auto, expect="a dtype")
    device: str = setting("auto", expect="auto, cpu, cuda, cuda:N or mps", check=device_problem)
    cache_dir: str | None = setting(None, expect="a directory (null: ~/.cache/kvbench/models)")
    seed: int = setting(0, expect="an integer (the random weights of source=tiny)")


@dataclass
class PolicyConfig:
    """A policy names its parts (see kvbench.policies.registry); the extras default to off for every policy."""

    name: str = setting(expect="the policy's name")
    score: Any = setting("none", expect="a score kind or {kind: ..., options}")
    scope: Any = setting("all", expect="a scope kind or {kind: ..., options}")
    allocation: Any = setting("uniform", expect="an allocation kind or {kind: ..., options}")
    merge: Any = setting(False, expect="true or false", check=merge_problem)
    quantize: str = setting("none", expect="none or a quantisation", check=quantize_problem)
    channels: Any = setting(None, expect="null or {kind: think, ratio: ..., window: ...}")
    positions: Positions = setting(Positions.absolute, expect="a position mode")
    sliding_layers: SlidingLayers = setting(SlidingLayers.window, expect="a sliding-layer mode")
    interval: int = setting(1, expect=INTERVAL, check=at_least(1, INTERVAL))
    # Decode-time sparsity with score none (kvbench.policies.sparse): the budget then counts attended keys
    sparsity: Any = setting("none", expect="none or a sparsity kind {kind: quest, page_size: ..., dense_layers: ...}")
    # stage=both: another named policy (configs/policy/) for one phase; null: this one (kvbench.policies.phased)
    prefill: str | None = setting(None, expect=PHASE_POLICY)
    decode: str | None = setting(None, expect=PHASE_POLICY)


@dataclass
class TaskConfig:
    """What every task shares; a task's own options are the fields of its dataclass, typed by
    ``kvbench.tasks.options`` when the task is built."""

    name: str = setting(expect="a task name")
    n: int | None = setting(
        None,
        expect="a positive integer (how many examples) or null (every example)",
        check=at_least(1, "a positive integer (how many examples) or null (every example)"),
    )
    fidelity: bool = setting(False, expect="true or false (also score against the full cache's output)")


SAMPLES = "a positive integer (samples drawn per prompt)"


@dataclass
class SamplingConfig:
    do_sample: bool = setting(False, expect="true or false")
    temperature: float = setting(1.0, expect="a number")
    top_p: float = setting(1.0, expect="a number")
    # Samples drawn per prompt, seeded seed, seed + 1, ...; above 1 the rows report pass@1 and pass@k.
    n_samples: int = setting(1, expect=SAMPLES, check=at_least(1, SAMPLES))


@dataclass
class CapacityConfig:
    """experiment=capacity: each cell finds its largest batch under a memory cap instead."""

    memory_gib: float | None = setting(
        None,
        expect="a positive number of GiB (or null: no capacity search)",
        check=at_least(0, "a positive number of GiB (or null: no capacity search)", inclusive=False),
    )
    max_batch: int = setting(1024, expect=POSITIVE, check=at_least(1, POSITIVE))


@dataclass
class WandbConfig:
    mode: WandbMode = setting(WandbMode.disabled, expect="a wandb mode")
    project: str = setting("kvbench", expect="a wandb project name")
    entity: str | None = setting(None, expect="a wandb entity or null")
    group: str | None = setting(None, expect="a wandb group or null (the sweep name)")


@dataclass
class TrackingConfig:
    wandb: WandbConfig = setting(factory=WandbConfig, expect="wandb settings")


STRIDE = "a positive integer (prefill chunk size) or null"
MAX_NEW = "a positive integer or null (the task's default)"
BATCH = "a positive integer (sequences decoded together)"


@dataclass
class RunSettings:
    """One cell's settings besides the model, policy and task groups (the top level of configs/config.yaml)."""

    budget: int | float = setting(
        0.5, expect="a number: a fraction in (0, 1] or an integer token count", check=budget_problem
    )
    stage: Stage = setting(Stage.prefill, expect="a stage")
    stride: int | None = setting(None, expect=STRIDE, check=at_least(1, STRIDE))
    batch_size: int = setting(1, expect=BATCH, check=at_least(1, BATCH))
    seed: int = setting(0, expect="an integer")
    max_new_tokens: int | None = setting(None, expect=MAX_NEW, check=at_least(1, MAX_NEW))
    sampling: SamplingConfig = setting(factory=SamplingConfig, expect="sampling settings")
    fidelity: bool = setting(False, expect="true or false (also score against the full cache's output)")
    capacity: CapacityConfig = setting(factory=CapacityConfig, expect="capacity settings")
    tracking: TrackingConfig = setting(factory=TrackingConfig, expect="tracking settings")
    results_dir: str = setting("results", expect="a directory")
    sweep_name: str = setting("runs", expect="a name (sweeps group their cells under results_dir/sweep_name)")
    print_table: bool = setting(True, expect="true or false (print a summary table when a multirun ends)")


@dataclass
class RunConfig(RunSettings):
    """The whole composed config, as ``validate`` reads it."""

    model: ModelConfig = setting(factory=ModelConfig, expect="model settings")
    policy: PolicyConfig = setting(factory=PolicyConfig, expect="policy settings")
    task: TaskConfig = setting(factory=TaskConfig, expect="task settings")
