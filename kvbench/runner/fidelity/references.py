"""What the full cache did with a prompt, and how far the run's policy strays from it.

A reference is the full cache's output for one rendered prompt: for a generation task its greedy (or seeded
sampled) output, for a teacher-forced task (perplexity) its next-token distributions along a given text. The run
then teacher-forces the same tokens through its own policy (one extra pass, run by the runner) and
``agreement`` compares the two: top-1 agreement and KL.

A reference's key names everything that decides the full cache's output: the model (name, source, path, dtype
and device as loaded, torch and transformers versions), the task and example, a hash of the prompt ids (context
and suffix apart), the decoding settings (max_new_tokens, stop strings, sampling, and the seed when sampling),
the prefill chunk (``stride``; chunking changes float rounding), the kind and ``K``. Policy, budget and stage
are not in it, so every policy and budget shares it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any

import torch

from kvbench.config import RunSpec
from kvbench.engine.engine import DecodeSettings, Engine, EngineSettings, Generation, Request
from kvbench.models import LoadedModel
from kvbench.policies.full import never_evicting
from kvbench.runner.fidelity.metrics import (
    fidelity_rouge_l,
    kl_divergence,
    summarize_logits,
    token_nll,
    top1_agreement,
    topk_mass,
)
from kvbench.runner.fidelity.store import FORMAT_VERSION, TOP_K, Reference, ReferenceStore
from kvbench.tasks.base import RenderedPrompt, Task

# The prefix of the metrics that compare a run with the full cache.
FIDELITY_PREFIX = "fidelity_"


def wants_fidelity(task: Task, spec: RunSpec) -> bool:
    """Fidelity to the full cache is scored when the run asks (``fidelity=true``), when the task's config does
    (``task.fidelity``: on by default for summarisation and LongBench), and always for tasks scored by fidelity
    alone."""
    return bool(spec.fidelity or spec.task_cfg.get("fidelity") or task.primary_metric.startswith(FIDELITY_PREFIX))


# ---------------------------------------------------------------- keys


def model_identity(model_cfg: dict[str, Any], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """What decides a model's numbers: its config (less where it is cached) and how it was loaded."""
    import transformers

    cfg = {k: v for k, v in sorted(model_cfg.items()) if k != "cache_dir"}
    return {
        "config": cfg,
        "device": device.type,
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def prompt_hash(input_ids: list[int], suffix_ids: list[int], extra: list[int] | None = None) -> str:
    payload = json.dumps([list(input_ids), list(suffix_ids), list(extra or [])], separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def decode_identity(settings: DecodeSettings) -> dict[str, Any]:
    """The settings that change what is generated; the seed only matters when sampling."""
    out = asdict(settings)
    if not settings.do_sample:
        out = {k: v for k, v in out.items() if k not in ("seed", "temperature", "top_p")}
    return out


def reference_key(
    kind: str,
    lm: LoadedModel,
    spec: RunSpec,
    example_id: str,
    prompt_digest: str,
    settings: DecodeSettings,
    top_k: int = TOP_K,
) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "kind": kind,
        "model": model_identity(spec.model, lm.device, lm.dtype),
        "task": spec.task_id,
        "example": str(example_id),
        "prompt": prompt_digest,
        "decode": decode_identity(settings),
        "stride": spec.stride,
        "top_k": top_k,
    }


# ---------------------------------------------------------------- the full cache's passes


def _full_cache(
    lm: LoadedModel,
    input_ids: list[int],
    suffix_ids: list[int],
    settings: DecodeSettings,
    stride: int | None,
    forced_tokens: list[int] | None = None,
) -> Generation:
    engine = Engine(lm.model, lm.tokenizer, EngineSettings(never_evicting(), stride=stride, return_logits=True))
    return engine.run([Request(input_ids, suffix_ids, settings, forced_tokens)])[0]


def generated_reference(
    lm: LoadedModel,
    input_ids: list[int],
    suffix_ids: list[int],
    settings: DecodeSettings,
    stride: int | None,
    top_k: int = TOP_K,
) -> Reference:
    """The full cache's generation for a prompt, with its per-step top-K log-probabilities."""
    g = _full_cache(lm, input_ids, suffix_ids, settings, stride)
    assert g.logits is not None, "the full cache's pass returns its logits"
    return Reference(
        tokens=list(g.tokens),
        text=g.text,
        stop_reason=g.measures.stop_reason,
        summary=summarize_logits(g.logits, top_k),
        argmax=g.logits.argmax(-1).tolist(),
    )


def forced_reference(
    lm: LoadedModel,
    input_ids: list[int],
    targets: list[int],
    settings: DecodeSettings,
    stride: int | None,
    top_k: int = TOP_K,
) -> Reference:
    """The full cache teacher-forced along ``targets``: each target's NLL and the top-K per step."""
    g = _full_cache(lm, input_ids, [], settings, stride, forced_tokens=targets)
    assert g.logits is not None, "the full cache's pass returns its logits"
    return Reference(
        tokens=list(targets),
        text="",
        stop_reason="forced",
        summary=summarize_logits(g.logits, top_k),
        argmax=g.logits.argmax(-1).tolist(),
        nll=token_nll(g.logits, targets).tolist(),
    )


def _generation_key(
    lm: LoadedModel, spec: RunSpec, example_id: str, prompt: RenderedPrompt, settings: DecodeSettings
) -> dict[str, Any]:
    return reference_key("generate", lm, spec, example_id, prompt_hash(prompt.input_ids, prompt.suffix_ids), settings)


def stored_generation_reference(
    lm: LoadedModel,
    spec: RunSpec,
    example_id: str,
    prompt: RenderedPrompt,
    settings: DecodeSettings,
    store: ReferenceStore,
) -> Reference | None:
    """The full cache's output for a prompt under ``settings`` if some run already stored it; never computed."""
    return store.load(_generation_key(lm, spec, example_id, prompt, settings))


def generation_reference(
    lm: LoadedModel,
    spec: RunSpec,
    example_id: str,
    prompt: RenderedPrompt,
    settings: DecodeSettings,
    store: ReferenceStore,
) -> tuple[Reference, str]:
    """The full cache's output for a prompt under ``settings`` (computed once, shared through ``store``) and the
    name of its file."""
    key = _generation_key(lm, spec, example_id, prompt, settings)
    ref = store.get_or_create(
        key, lambda: generated_reference(lm, prompt.input_ids, prompt.suffix_ids, settings, spec.stride)
    )
    return ref, store.path(key).name


def text_reference(
    lm: LoadedModel,
    spec: RunSpec,
    example_id: str,
    input_ids: list[int],
    targets: list[int],
    settings: DecodeSettings,
    store: ReferenceStore,
) -> tuple[Reference, str]:
    """The full cache teacher-forced along ``targets`` after ``input_ids`` (computed once, shared through
    ``store``) and the name of its file."""
    key = reference_key("teacher_forced", lm, spec, example_id, prompt_hash(input_ids, [], targets), settings)
    ref = store.get_or_create(key, lambda: forced_reference(lm, input_ids, targets, settings, spec.stride))
    return ref, store.path(key).name


# ---------------------------------------------------------------- comparing a run with it


def agreement(ref: Reference, logits: torch.Tensor, targets: list[int]) -> dict[str, float]:
    """The run's next-token logits (teacher-forced along the reference) against the full cache's: how often its
    argmax is ``targets``' token, the KL (see :mod:`kvbench.runner.fidelity.metrics` for exactly which), and the
    mass the stored top-K holds."""
    return {
        FIDELITY_PREFIX + "top1": top1_agreement(logits, targets),
        FIDELITY_PREFIX + "kl": kl_divergence(ref.summary, logits),
        FIDELITY_PREFIX + "topk_mass": topk_mass(ref.summary),
    }


def generation_agreement(
    ref: Reference, logits: torch.Tensor, prediction: str, reference_prediction: str
) -> dict[str, float]:
    """``agreement`` along the full cache's generated tokens, plus ROUGE-L between the two predictions (both
    post-processed by the task)."""
    rouge = {FIDELITY_PREFIX + "rougeL": fidelity_rouge_l(prediction, reference_prediction)}
    return {**rouge, **agreement(ref, logits, ref.tokens)}
