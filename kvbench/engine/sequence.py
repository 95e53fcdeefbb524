"""One sequence of a run: what it asks for (``Request``), where it stands (``Sequence``) and what it produced
(``Generation``, with the row's ``Measures``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvbench.engine.cache.cache import KVCache
from kvbench.engine.measure import latency_summary
from kvbench.engine.plan import LayerPlan
from kvbench.engine.replay import Pass
from kvbench.engine.sampling import DecodeSettings, choose_token, cut_at_stop, hit_stop
from kvbench.results.schema import Measures, Timings


@dataclass
class Request:
    """A prompt (``suffix_ids`` are fed after the context is compressed: a question the policy must not see while
    compressing). ``forced_tokens`` teacher-forces the decode (fidelity metrics); ``replay_trace`` (another run's
    ``trace``, used with the full cache) masks every step's past down to what that run held. Requests that give the
    same ``context_id`` (and the same ``input_ids``) share one prefill of the context: each starts from its own
    copy of the compressed context and feeds its own ``suffix_ids`` (``engine.contexts``)."""

    input_ids: list[int]
    suffix_ids: list[int] = field(default_factory=list)
    settings: DecodeSettings = field(default_factory=DecodeSettings)
    forced_tokens: list[int] | None = None
    replay_trace: list[list[torch.Tensor]] | None = None
    context_id: str | None = None


@dataclass
class Generation:
    """What one request produced: its tokens and text, the measures its row records (built once, here), each
    decode step's seconds and how many sequences shared it, and, when the run asked, each step's logits
    [steps, V] and each forward's kept positions (per layer, [KV heads, kept])."""

    tokens: list[int]
    text: str
    measures: Measures
    batch_size: int = 1  # the run's: how many sequences may decode together
    decode_latencies_s: list[float] = field(default_factory=list)
    decode_batch_sizes: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None
    trace: list[list[torch.Tensor]] | None = None


@dataclass
class Sequence:
    index: int
    request: Request
    plans: list[LayerPlan]
    budget_tokens: int | None
    chunk: int
    device: torch.device
    lane: int = -1  # where in the batch it decodes
    position: int = 0
    forwards: int = 0
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    traces: list[list[torch.Tensor]] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    step_batches: list[int] = field(default_factory=list)
    kept_after_prefill: list[float] = field(default_factory=list)
    resident_peak: int = 0  # bytes held at the end of a step, at most
    kept_peak: float = 0.0  # entries held at the end of a step (mean over layers), at most
    t0: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    peak_prefill: tuple[int, str] = (0, "")
    prefill_shared: bool = False  # its context was prefilled for an earlier request: it fed only its suffix
    rereads: bool = False  # its context is fed twice, the second pass scoring the first (``Score.rereads``)
    stop_reason: str | None = None
    cache: KVCache | None = None  # the cache its lane is in, while it is live
    replays: list[Pass] = field(default_factory=list)  # the prompt's replay passes (KVzip), fed after it
    sampler: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.sampler = torch.Generator(device=self.device)
        self.sampler.manual_seed(self.request.settings.seed)

    def take(self, logits: torch.Tensor, greedy: int | None = None, keep_logits: bool = False) -> None:
        """Append the next token: the forced one, the batch's greedy choice, or one sampled from ``logits``."""
        forced = self.request.forced_tokens
        if forced:
            token = forced[len(self.tokens)]
        elif greedy is not None:
            token = greedy
        else:
            token = int(choose_token(logits, self.request.settings, self.sampler))
        self.tokens.append(token)
        if keep_logits:
            self.logits.append(logits.float().cpu())

    def stopped(self, stops: set[int], tokenizer: Any) -> bool:
        """Whether the generation is over (``stop_reason`` says why): its length, an end token or a stop string."""
        settings, forced = self.request.settings, self.request.forced_tokens
        limit = len(forced) if forced else settings.max_new_tokens
        if len(self.tokens) >= limit:
            self.stop_reason = "max_new_tokens"
        elif not forced and self.tokens[-1] in stops:
            self.stop_reason = "eos"
        elif not forced and settings.stop_strings and hit_stop(tokenizer, self.tokens, settings.stop_strings):
            self.stop_reason = "stop_string"
        return self.stop_reason is not None


def reference_length(stage: str, context: int, suffix: int, max_new_tokens: int) -> int:
    """What a fractional budget is a fraction of: the prompt for prefill/both, the whole sequence for decode."""
    return context + suffix + max_new_tokens if stage == "decode" else context


def finished_generation(
    seq: Sequence, tokenizer: Any, stage: str, windows: list[int | None], batch_size: int, peak: tuple[int, str]
) -> Generation:
    """The sequence's ``Generation``, read from its lane before the lane is handed on; ``peak``: the device's
    peak memory and what it measures."""
    assert seq.cache is not None, "a sequence is finished while it is live"
    summary = seq.cache.summary(seq.lane)
    n_layers = len(windows)
    request = seq.request
    context = len(request.input_ids)
    seen = seq.position
    kept = round(sum(summary.kept_per_layer) / n_layers, 9)  # a mean of counts: no float summation residue
    if stage == "prefill":
        per_layer = [k / context for k in seq.kept_after_prefill]
        achieved = sum(per_layer) / n_layers
    else:
        achieved = kept / seen
        per_layer = [k / seen for k in summary.kept_per_layer]
    text = tokenizer.decode(seq.tokens, skip_special_tokens=True) if tokenizer is not None else ""
    if seq.stop_reason == "stop_string":
        text = cut_at_stop(text, request.settings.stop_strings)
    prompt_tokens = context + len(request.suffix_ids)
    fed = len(request.suffix_ids) if seq.prefill_shared else prompt_tokens  # what its prefill seconds fed
    measures = Measures(
        budget_tokens=seq.budget_tokens,
        budget_achieved=achieved,
        budget_achieved_per_layer=per_layer,
        kept_tokens=kept,
        peak_kept_tokens=seq.kept_peak,
        seen_tokens=seen,
        kv_resident_bytes=summary.resident_bytes,
        kv_resident_peak_bytes=seq.resident_peak,
        **by_layer_kind(windows, per_layer, summary.resident_per_layer),
        kv_capacity_bytes=summary.capacity_bytes,
        peak_memory_prefill_bytes=seq.peak_prefill[0],
        peak_memory_bytes=peak[0],
        peak_memory_kind=peak[1],
        timings=timings(seq.prefill_s, seq.ttft_s, fed, seq.latencies, seq.step_batches),
        prompt_tokens=prompt_tokens,
        new_tokens=len(seq.tokens),
        stop_reason=seq.stop_reason or "max_new_tokens",
        prefill_shared=seq.prefill_shared,
    )
    return Generation(
        tokens=seq.tokens,
        text=text,
        measures=measures,
        batch_size=batch_size,
        decode_latencies_s=seq.latencies,
        decode_batch_sizes=seq.step_batches,
        logits=torch.stack(seq.logits) if seq.logits else None,
        trace=seq.traces or None,
    )


def timings(prefill_s: float, ttft_s: float, prompt_tokens: int, steps_s: list[float], sizes: list[int]) -> Timings:
    """The prefill, the decode steps' latency, and the batch the sequence shared them with."""
    latency = latency_summary(steps_s)
    total = sum(steps_s)
    return Timings(
        prefill_s=prefill_s,
        ttft_s=ttft_s,
        prefill_tokens_per_s=prompt_tokens / prefill_s if prefill_s > 0 else None,
        decode_ms_mean=latency.mean_ms,
        decode_ms_p50=latency.p50_ms,
        decode_ms_p95=latency.p95_ms,
        decode_tokens_per_s=latency.per_s,
        batch_decode_tokens_per_s=sum(sizes) / total if total > 0 else None,
        decode_batch_mean=sum(sizes) / len(sizes) if sizes else None,
    )


def by_layer_kind(windows: list[int | None], achieved: list[float], resident: list[int]) -> dict[str, Any]:
    """Achieved budget (mean over layers) and resident bytes of the full-attention and the sliding layers."""
    out: dict[str, Any] = {}
    for kind, members in (("full", [w is None for w in windows]), ("sliding", [w is not None for w in windows])):
        chosen = [i for i, member in enumerate(members) if member]
        out[f"budget_achieved_{kind}"] = sum(achieved[i] for i in chosen) / len(chosen) if chosen else None
        out[f"kv_resident_bytes_{kind}"] = sum(resident[i] for i in chosen) if chosen else None
    return out


def with_question(request: Request) -> tuple[Request, int]:
    """A request for a score that observes the prompt's question (Finch): its suffix, the question the task feeds
    apart, joins the prompt, compressed with it, and the score is told how many of the prompt's last tokens it is."""
    if not request.suffix_ids:
        raise ValueError(
            "the policy's score observes the prompt's question, and this request has none apart from its context "
            "(suffix_ids); give the question as the suffix (a task's question_aware=false)"
        )
    if request.context_id is not None:
        raise ValueError(
            "the policy's score compresses each context with its own question, so contexts cannot be shared "
            "between questions; use task.ask=all"
        )
    joined = replace(request, input_ids=[*request.input_ids, *request.suffix_ids], suffix_ids=[])
    return joined, len(request.suffix_ids)
