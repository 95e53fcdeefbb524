"""The run's policy over its prompts, exactly as a timed run does it, and an example's outcome from what the
engine returned. Generation, teacher forcing for fidelity, and perplexity all go through here."""

from __future__ import annotations

from typing import Any

from kvbench.config import RunSpec
from kvbench.engine.engine import DecodeSettings, Engine, EngineSettings, Generation, Request
from kvbench.models import LoadedModel
from kvbench.results.schema import Outcome
from kvbench.stages import Stage
from kvbench.tasks.base import Example, RenderedPrompt, Task


def example_settings(task: Task, spec: RunSpec, ex: Example, sample: int = 0) -> DecodeSettings:
    """The task's settings for the example, with the run's overrides (max_new_tokens, sampling, seed); ``sample``:
    which of the prompt's ``sampling.n_samples`` samples (its seed is the run's plus ``sample``)."""
    settings = task.generation(ex)
    return spec.decode_settings(settings.max_new_tokens, settings.stop_strings, sample)


def run_engine(lm: LoadedModel, spec: RunSpec, batch_size: int = 1, return_logits: bool = False) -> Engine:
    """The engine under the run's policy, budget, stage and prefill chunk."""
    settings = EngineSettings(
        spec.policy, spec.budget, Stage(spec.stage), batch_size, spec.stride, return_logits=return_logits
    )
    return Engine(lm.model, lm.tokenizer, settings)


def policy_pass(
    lm: LoadedModel, spec: RunSpec, prompt: RenderedPrompt, settings: DecodeSettings, forced_tokens: list[int]
) -> Generation:
    """``prompt`` alone under the run's policy, teacher-forced along ``forced_tokens``, with its logits."""
    request = Request(prompt.input_ids, prompt.suffix_ids, settings, forced_tokens)
    return run_engine(lm, spec, return_logits=True).run([request])[0]


def outcome(task: Task, metrics: dict[str, Any], g: Generation, prompt: RenderedPrompt, **fields: Any) -> Outcome:
    """An example's outcome: the task's metrics beside what the engine measured; ``fields``: the rest."""
    return Outcome(
        primary_metric=task.primary_metric,
        score=metrics.get(task.primary_metric),
        metrics=metrics,
        measures=g.measures,
        truncated=prompt.truncated,
        **fields,
    )
