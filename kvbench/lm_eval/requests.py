"""lm-eval's requests as kvbench's: generation settings from a task's ``gen_kwargs``, teacher-forced requests for
log-likelihoods, and the measures each request's sample logs.

lm-eval's own helpers normalise ``gen_kwargs`` and cut a generation at its stop sequences, so a request means to
kvbench what it means to lm-eval's ``hf`` model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

from kvbench.engine.engine import DecodeSettings, Generation
from kvbench.results.schema import Measures

# Sampling settings kvbench's decoder has; any other gen_kwargs key would be silently ignored, so it is refused.
SAMPLING_KEYS = {"do_sample", "temperature", "top_p"}
LOG_KEY = "kvbench"  # the per-sample log's entry of kvbench's measures


def decode_settings(
    gen_kwargs: dict[str, Any], default_max: int, eos: str, seed: int
) -> tuple[DecodeSettings, list[str]]:
    """The decoder's settings for one request, and the stop sequences its text is cut at (the EOS text among
    them, as lm-eval's ``hf`` model does); ``ValueError`` for a setting kvbench cannot honour."""
    kwargs = normalize_gen_kwargs(gen_kwargs, default_max)
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    max_gen_toks = int(kwargs.pop("max_gen_toks"))
    unknown = sorted(set(kwargs) - SAMPLING_KEYS)
    if unknown:
        raise ValueError(
            f"gen_kwargs {', '.join(unknown)} have no kvbench decoder setting (it has max_gen_toks, until, "
            f"{', '.join(sorted(SAMPLING_KEYS))}); drop them with --gen_kwargs or run lm-eval's own model"
        )
    do_sample = bool(kwargs.get("do_sample", False))
    temperature = float(kwargs.get("temperature", 0.0))
    if do_sample and temperature <= 0:
        raise ValueError("gen_kwargs do_sample=true needs temperature > 0 (or do_sample=false for greedy decoding)")
    settings = DecodeSettings(
        max_new_tokens=max_gen_toks,
        do_sample=do_sample,
        temperature=temperature if do_sample else 1.0,
        top_p=float(kwargs.get("top_p", 1.0)) if do_sample else 1.0,
        seed=seed,
        stop_strings=[s for s in until if s],
    )
    return settings, until


def repeat_seeds(requests: Sequence[Any], seed: int) -> list[int]:
    """lm-eval passes a request ``repeats`` times in a row (the same object): each copy samples from its own seed
    (the run's seed, then + 1, ...), as kvbench's ``sampling.n_samples`` does."""
    seen: dict[int, int] = {}
    seeds = []
    for request in requests:
        copy = seen.get(id(request), 0)
        seen[id(request)] = copy + 1
        seeds.append(seed + copy)
    return seeds


def forced_window(context: list[int], continuation: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """The prompt and the tokens to score of one log-likelihood request, left-truncated to ``max_length`` tokens
    fed (the last continuation token is scored, never fed), as lm-eval's ``hf`` model truncates."""
    if not continuation or len(continuation) > max_length:
        raise ValueError(f"a continuation of {len(continuation)} tokens cannot be scored within {max_length}")
    whole = (context + continuation)[-(max_length + 1) :]
    return whole[: len(whole) - len(continuation)], continuation


def scored(g: Generation, targets: list[int]) -> tuple[float, bool]:
    """The log-likelihood of ``targets`` from the logits that predicted them, and whether each was the argmax."""
    assert g.logits is not None and len(g.logits) == len(targets), "a teacher-forced request returns its logits"
    logprobs = torch.log_softmax(g.logits.float(), dim=-1)
    wanted = torch.tensor(targets, device=logprobs.device)
    total = logprobs.gather(-1, wanted[:, None]).sum().item()
    greedy = bool((logprobs.argmax(dim=-1) == wanted).all())
    return float(total), greedy


def logged(measures: Measures) -> dict[str, Any]:
    """One request's measures as the per-sample log holds them (plain JSON)."""
    return dataclasses.asdict(measures)


def attach(requests: Sequence[Any], measures: Sequence[Any]) -> None:
    """Add each request's measures (one per repeat, in order) to its logged arguments: lm-eval's per-sample log
    writes ``arguments`` beside the responses, so they land as ``arguments.gen_args_<i>.arg_<last>``."""
    per_request: dict[int, tuple[Any, list[Any]]] = {}
    for request, measure in zip(requests, measures):
        per_request.setdefault(id(request), (request, []))[1].append(measure)
    for request, collected in per_request.values():
        request.arguments = (*request.args, {LOG_KEY: collected})
