"""Many sequences through one cache: each prompt prefilled on its own, then decoded together, one forward per
step for every live sequence; a finished sequence's slot is refilled from the queue, so the batch stays full.

Every fed token gets its true index in its own sequence (the cache's length is never the position), and each
sequence keeps its own budget, statistics, sampler, stop strings, EOS and ``max_new_tokens``. At ``batch_size``
1 the one cache holds the prompt and the decode alike (what a single-sequence run needs). Larger batches decode
in rows sized for decoding (the budget, not the prompt) and prefill each prompt in a cache of its own, whose
kept rows then move into the sequence's slot: the prompt's full cache is working memory of one sequence at a
time, never of the batch.
"""

from __future__ import annotations

import inspect
from collections import deque
from typing import Any

import torch

from kvbench.budget import too_small
from kvbench.engine import allocator, measure
from kvbench.engine.attention import kvbench_attention_enabled
from kvbench.engine.cache.cache import KVCache
from kvbench.engine.fused_llama import FusedLlama, supports
from kvbench.engine.plan import plan_layers
from kvbench.engine.sampling import choose_token, eos_ids, hit_stop
from kvbench.engine.sequence import Request, Sequence, finished_generation, reference_length, resolve_budget
from kvbench.families import check_supported, layer_windows
from kvbench.policies.base import Policy

STAGES = ("prefill", "decode", "both")


def cache_argument(model: Any) -> str:
    """transformers 5 renamed ``past_key_values`` to ``cache``; accept either."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def fused_forward_for(model: Any, fused: bool | None) -> FusedLlama | None:
    """The model's fused forward, built once and kept on the model; None where it does not apply. By default CPU
    only: an accelerator's kernels take transposed weights as they are, and fused copies would double them."""
    if fused is False or (fused is None and next(model.parameters()).device.type != "cpu"):
        return None
    ok, why = supports(model)
    if not ok:
        if fused:
            raise ValueError(f"fused=true but {why}; use fused=false")
        return None
    key = (next(model.parameters()).device, next(model.parameters()).dtype)
    cached = getattr(model, "_kvbench_fused", None)
    if cached is None or cached[0] != key:
        cached = (key, FusedLlama(model))
        model._kvbench_fused = cached
    return cached[1]


class BatchRun:
    """The requests' generations, advanced one unit of work per ``step()`` (one prompt's prefill, or one decode
    step of the batch), so that a benchmark can interleave several runs."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        requests: list[Request],
        policy: Policy,
        budget: float | int,
        stage: str = "prefill",
        batch_size: int = 1,
        stride: int | None = None,
        return_logits: bool = False,
        trace: bool = False,
        fused: bool | None = None,
    ):
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; choose one of {STAGES}")
        if batch_size < 1:
            raise ValueError(f"batch_size {batch_size} must be >= 1")
        check_supported(model.config)
        self.model, self.tokenizer, self.policy, self.stage = model, tokenizer, policy, stage
        self.batch_size, self.return_logits, self.trace = batch_size, return_logits, trace
        self.device = next(model.parameters()).device
        self.windows = layer_windows(model.config)
        self.prefill_evicts = stage in ("prefill", "both")
        self.decode_evicts = stage in ("decode", "both")
        self.sequences = [self._sequence(i, r, budget, stride) for i, r in enumerate(requests)]
        self.cache_kw = cache_argument(model)
        if self.device.type == "cpu":
            allocator.map_large_blocks_alone()
        self.fused = fused_forward_for(model, fused)
        if self.fused is not None:
            self.fused.pack(batch_size)
        self.stops = eos_ids(model, tokenizer)
        self.queue = deque(self.sequences)
        self.live: list[Sequence] = []
        self.batch: KVCache | None = None
        if batch_size > 1:
            self.batch = KVCache(
                [s.plans for s in self.sequences],
                policy,
                slots=batch_size,
                role="decode",
                seed=self._seed(),
                device=self.device,
                model=model,
            )
        self.started = False

    def _seed(self) -> int:
        return self.sequences[0].request.settings.seed if self.sequences else 0

    def _sequence(self, index: int, request: Request, budget: float | int, stride: int | None) -> Sequence:
        context, suffix = len(request.input_ids), len(request.suffix_ids)
        if context < 1:
            raise ValueError("the prompt is empty")
        chunk = stride or context
        if chunk < 1:
            raise ValueError(f"stride {stride} must be >= 1")
        new = request.settings.max_new_tokens
        tokens = (
            resolve_budget(budget, reference_length(self.stage, context, suffix, new)) if self.policy.evicts else None
        )
        problem = None if tokens is None else too_small(tokens, self.policy)
        if problem:
            raise ValueError(f"budget of {problem}")
        plans = plan_layers(self.policy, tokens, self.windows, self.stage, context, suffix, new, chunk)
        return Sequence(index, request, plans, tokens, chunk, self.device)

    # -- driving -----------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One unit of work; False once every request is done."""
        if not self.started:
            measure.reset_peak(self.device)
            self.started = True
        with torch.inference_mode(), kvbench_attention_enabled(self.model):
            if self.queue and len(self.live) < self.batch_size:
                self._admit(self.queue.popleft())
            elif self.live:
                self._decode_step()
            else:
                return False
        return bool(self.queue or self.live)

    def run(self) -> list[Any]:
        with kvbench_attention_enabled(self.model):  # held for the whole run, not set again at every step
            while self.step():
                pass
        return self.results()

    def results(self) -> list[Any]:
        return [s.generation for s in self.sequences]

    # -- forwards ----------------------------------------------------------------------------------------------
    def _forward(
        self, cache: KVCache, lo: int, seqs: list[Sequence], ids: list[list[int]], evicting: bool, phase: str
    ) -> torch.Tensor:
        """One forward of slots ``lo:lo + len(seqs)``; the last position's logits [B, V]."""
        positions = [[s.position + i for i in range(len(t))] for s, t in zip(seqs, ids)]
        fed = cache.begin_step(lo, lo + len(seqs), positions, evicting, phase, collecting=self.decode_evicts)
        cache.hidden = self._replay_masks(cache, seqs, positions)
        input_ids = torch.tensor(ids, device=self.device)
        if self.fused is not None:
            logits = self.fused(input_ids, fed, cache)
        else:
            logits = self.model(
                input_ids=input_ids,
                position_ids=fed,
                use_cache=True,
                logits_to_keep=1,
                kvbench_cache=cache,
                **{self.cache_kw: cache},
            ).logits[:, -1]
        cache.end_step()
        cache.hidden = None
        resident = cache.resident_by_slot(lo, lo + len(seqs))
        for i, (s, t) in enumerate(zip(seqs, ids)):
            s.position += len(t)
            s.forwards += 1
            s.resident_peak = max(s.resident_peak, resident[i])
            if self.trace:
                s.traces.append(cache.kept_positions(lo + i))
        return logits

    def _replay_masks(
        self, cache: KVCache, seqs: list[Sequence], positions: list[list[int]]
    ) -> list[torch.Tensor] | None:
        """Masked replay: each layer's past hidden down to what the traced run held at this step, by position."""
        traced = [s.request.replay_trace for s in seqs]
        if all(t is None for t in traced) or all(s.forwards == 0 for s in seqs):
            return None
        if any(t is None for t in traced):
            raise ValueError("masked replay needs a trace for every sequence of the batch")
        width = max(p[-1] for p in positions) + 1
        masks: list[torch.Tensor] = []
        for l in range(len(cache.layers)):
            rows = []
            for s, p, trace in zip(seqs, positions, traced):
                assert trace is not None, "checked above: every sequence has a trace"
                held = trace[s.forwards - 1][l].to(self.device)
                by_position = torch.zeros(held.shape[0], width, dtype=torch.bool, device=self.device)
                by_position.scatter_(1, held, True)
                by_position[:, p[0] :] = True  # the step's own tokens
                rows.append(by_position)
            masks.append(torch.cat(rows))
        return masks

    def _admit(self, seq: Sequence) -> None:
        """Prefill one prompt (its chunks, then the suffix) and give the sequence a slot of the batch."""
        slot = len(self.live)
        cache = KVCache(
            [seq.plans],
            self.policy,
            slots=1,
            role="both" if self.batch is None else "prefill",
            seed=seq.request.settings.seed,
            device=self.device,
            model=self.model,
        )
        cache.assign(0, seq.plans)
        request = seq.request
        seq.t0 = measure.now(self.device)
        ids = request.input_ids
        logits = None
        for start in range(0, len(ids), seq.chunk):
            logits = self._forward(cache, 0, [seq], [ids[start : start + seq.chunk]], self.prefill_evicts, "prefill")
        seq.kept_after_prefill = cache.summary(0).kept_per_layer
        if request.suffix_ids:
            logits = self._forward(cache, 0, [seq], [list(request.suffix_ids)], False, "prefill")
        seq.prefill_s = measure.now(self.device) - seq.t0
        assert logits is not None, "a prompt has at least one chunk"
        self._take(seq, logits[0])
        seq.ttft_s = measure.now(self.device) - seq.t0
        seq.peak_prefill = measure.peak_memory_bytes(self.device)
        if self.batch is None:
            seq.cache = cache
        else:
            self.batch.copy_slot(cache, 0, slot)
            seq.cache = self.batch
            del cache
            if self.device.type == "cpu":  # the prompt's working memory goes back to the system, not to the heap
                measure.trim_freed_memory(collect=False)
        seq.slot = slot
        self.live.append(seq)
        self._retire([seq] if self._stop(seq) else [])

    def _decode_step(self) -> None:
        seqs = self.live
        cache = self.batch if self.batch is not None else seqs[0].cache
        t = measure.now(self.device)
        logits = self._forward(cache, 0, seqs, [[s.tokens[-1]] for s in seqs], self.decode_evicts, "decode")
        greedy = None
        if all(not s.request.settings.do_sample and not s.request.forced_tokens for s in seqs):
            greedy = logits.argmax(dim=-1).tolist()
        for i, s in enumerate(seqs):
            self._take(s, logits[i], None if greedy is None else greedy[i])
        dt = measure.now(self.device) - t
        for s in seqs:
            s.latencies.append(dt)
            s.step_batches.append(len(seqs))
        self._retire([s for s in seqs if self._stop(s)])

    def _take(self, seq: Sequence, logits: torch.Tensor, greedy: int | None = None) -> None:
        forced = seq.request.forced_tokens
        if forced:
            token = forced[len(seq.tokens)]
        elif greedy is not None:
            token = greedy
        else:
            token = int(choose_token(logits, seq.request.settings, seq.sampler))
        seq.tokens.append(token)
        if self.return_logits:
            seq.logits.append(logits.float().cpu())

    def _stop(self, seq: Sequence) -> bool:
        settings, forced = seq.request.settings, seq.request.forced_tokens
        limit = len(forced) if forced else settings.max_new_tokens
        if len(seq.tokens) >= limit:
            seq.stop_reason = "max_new_tokens"
        elif not forced and seq.tokens[-1] in self.stops:
            seq.stop_reason = "eos"
        elif not forced and settings.stop_strings and hit_stop(self.tokenizer, seq.tokens, settings.stop_strings):
            seq.stop_reason = "stop_string"
        return seq.stop_reason is not None

    def _retire(self, done: list[Sequence]) -> None:
        """Finish ``done`` and close the batch's gaps: the last live sequence moves into a freed slot."""
        for seq in sorted(done, key=lambda s: -s.slot):
            peak, kind = measure.peak_memory_bytes(self.device)
            seq.generation = finished_generation(
                seq, self.tokenizer, self.stage, self.windows, self.batch_size, peak, kind
            )
            last = self.live[-1]
            if last is not seq:
                assert self.batch is not None, "two live sequences share the batch's cache"
                self.batch.copy_slot(self.batch, last.slot, seq.slot)
                self.live[seq.slot] = last
                last.slot = seq.slot
            self.live.pop()
            seq.cache = None
