"""Many sequences through one cache: each prompt prefilled on its own, then decoded together, one forward per
step for every live sequence; a finished sequence's lane is refilled from the queue, so the batch stays full.

Every fed token gets its true index in its own sequence (the cache's length is never the position), and each
sequence keeps its own budget, statistics, sampler, stop strings, EOS and ``max_new_tokens``. At ``batch_size``
1 the one cache holds the prompt and the decode alike (what a single-sequence run needs). Larger batches decode
in rows sized for decoding (the budget, not the prompt) and prefill each prompt in a cache of its own, whose
kept rows then move into the sequence's lane: the prompt's full cache is working memory of one sequence at a
time, never of the batch.
"""

from __future__ import annotations

import inspect
from collections import deque
from typing import Any

import torch

from kvbench.budget import budget_tokens, too_small
from kvbench.engine import measure
from kvbench.engine.attention import attending, kvbench_attention_enabled
from kvbench.engine.cache.cache import KVCache
from kvbench.engine.contexts import Prefilled, SharedContexts
from kvbench.engine.fused_llama import FusedLlama
from kvbench.engine.masked_replay import replay_masks
from kvbench.engine.plan import LayerPlan, plan_layers
from kvbench.engine.prompt_feed import prefill_context
from kvbench.engine.replay import hidden_norms, passes
from kvbench.engine.replay_gradient import autograd_mode, gradient_pass
from kvbench.engine.sampling import eos_ids
from kvbench.engine.sequence import (
    Generation,
    Request,
    Sequence,
    finished_generation,
    reference_length,
    with_question,
)
from kvbench.engine.settings import EngineSettings
from kvbench.engine.step import Phase, Reconstruction, Step

# A request finished by a unit of work: its index in the request list, and its generation or what made it fail.
Finished = tuple[int, Generation | Exception]


def cache_argument(model: Any) -> str:
    """transformers 5 renamed ``past_key_values`` to ``cache``; accept either."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class BatchLoop:
    """The requests' generations, advanced one unit of work per ``step()`` (one prompt's prefill, or one decode
    step of the batch). Built by ``Engine.steps``."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        settings: EngineSettings,
        windows: list[int | None],
        fused: FusedLlama | None,
        requests: list[Request],
    ):
        self.model, self.tokenizer, self.settings, self.windows, self.fused = model, tokenizer, settings, windows, fused
        self.policy, self.stage, self.batch_size = settings.policy, settings.stage, settings.batch_size
        self.device = next(model.parameters()).device
        self.sequences: list[Sequence] = []
        self.contexts = SharedContexts()
        self.refused: list[Finished] = []  # requests that cannot run: finished by the first unit of work
        for i, request in enumerate(requests):
            try:
                self.sequences.append(self._sequence(i, request))
            except ValueError as err:
                self.refused.append((i, err))
        self.cache_kw = cache_argument(model)
        self.stops = eos_ids(model, tokenizer)
        self.queue = deque(self.sequences)
        self.live: list[Sequence] = []
        self.batch: KVCache | None = None
        if self.batch_size > 1 and self.sequences:
            self.batch = KVCache(
                [s.plans for s in self.sequences],
                self.policy,
                lanes=self.batch_size,
                phases=(Phase.decode,),
                seed=self.sequences[0].request.settings.seed,
                device=self.device,
                model=model,
            )
        self.started = False
        self.finished: list[Finished] = []

    def _sequence(self, index: int, request: Request) -> Sequence:
        observe = None
        if self.policy.question and self.stage.evicts_in(Phase.prefill):
            request, observe = with_question(request)
        context, suffix = len(request.input_ids), len(request.suffix_ids)
        if context < 1:
            raise ValueError("the prompt is empty")
        new = request.settings.max_new_tokens
        budget = self.settings.budget
        reference = reference_length(self.stage, context, suffix, new)
        tokens = budget_tokens(budget, reference) if self.policy.budgeted else None  # held keys, or attended ones
        problem = None if tokens is None else too_small(tokens, self.policy)
        if problem:
            raise ValueError(f"budget of {problem}")
        evicts = self.stage.evicts_in(Phase.prefill)
        replays = passes(self.tokenizer, request.input_ids, self.policy.replay) if evicts else []
        longest = max((len(ids) for _, ids in replays), default=0)
        # A re-reading policy holds the context twice until the second pass's eviction (where it evicts at all).
        rereads = self.policy.rereads and evicts and tokens is not None and tokens < context
        fed = 2 * context if rereads else context
        chunk = self.settings.stride or fed
        held = tokens if self.policy.evicts else None
        plans = plan_layers(self.policy, held, self.windows, self.stage, fed, suffix, new, chunk, longest, observe)
        if request.context_id is not None:
            self.contexts.join(request.context_id, request.input_ids, plans, evicts)
        return Sequence(index, request, plans, tokens, chunk, self.device, replays=replays, rereads=rereads)

    # -- driving -----------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return not (self.queue or self.live or self.refused)

    def step(self) -> list[Finished]:
        """One unit of work; the requests it finished. A unit that fails finishes the requests it was working
        on (the prompt being prefilled, or every live sequence) with its error; the others go on."""
        if not self.started:
            measure.reset_peak(self.device)
            self.started = True
        self.finished, self.refused = self.refused, []
        working = list(self.live)
        try:
            with autograd_mode(self.policy.replay), kvbench_attention_enabled(self.model):
                if self.queue and len(self.live) < self.batch_size:
                    working = [self.queue.popleft()]
                    self._admit(working[0])
                elif self.live:
                    self._decode_step()
        except Exception as err:
            self.live = [s for s in self.live if s not in working]  # all of them, or the newest lane's
            self.finished += [(s.index, err) for s in working]
            for s in working:
                s.cache = None
        return self.finished

    # -- forwards ----------------------------------------------------------------------------------------------
    def forward(
        self,
        cache: KVCache,
        seqs: list[Sequence],
        ids: list[list[int]],
        phase: Phase,
        evicts: bool,
        replay: Reconstruction | None = None,
    ) -> torch.Tensor:
        """One forward of lanes ``0:len(seqs)``; the last position's logits [B, V]. ``replay``: a replay pass of
        the prompt (fed after it, leaving the sequence where it was)."""
        positions = [[s.position + i for i in range(len(t))] for s, t in zip(seqs, ids)]
        step = Step(
            lanes=range(len(seqs)),
            positions=positions,
            phase=phase,
            evicts=evicts,
            collects=replay is None and (evicts or self.stage.evicts_in(Phase.decode)),
            prepares=phase is not Phase.decode or cache.evictor.prepares(range(len(seqs))),
            replay_masks=None if replay else replay_masks(len(self.windows), seqs, positions, self.device),
            attended=self._attended(seqs, phase),
            replay=replay,
        )
        fed = cache.begin(step)
        input_ids = torch.tensor(ids, device=self.device)
        kind = self.policy.replay if replay is not None else None
        weighed = gradient_pass(self.model, cache, kind is not None and kind.gradient)
        with attending(cache), hidden_norms(self.model, cache, kind is not None and kind.plus), weighed:
            # A KVzip+ or KVgrad pass reads the attention modules' hooks, which the fused forward does not call.
            if self.fused is not None and (kind is None or not (kind.plus or kind.gradient)):
                logits = self.fused(input_ids, fed, cache)
            else:
                logits = self.model(
                    input_ids=input_ids, position_ids=fed, use_cache=True, logits_to_keep=1, **{self.cache_kw: cache}
                ).logits[:, -1]
        cache.finish(step)
        held = cache.held_by_lane(step.lanes)
        for i, (s, t, (resident, kept)) in enumerate(zip(seqs, ids, held)):
            s.resident_peak = max(s.resident_peak, resident)
            s.kept_peak = max(s.kept_peak, kept)
            if replay is not None:  # the trace's entry for the prompt's last chunk is what the replay kept
                if self.settings.trace:
                    s.traces[-1] = cache.kept_positions(i)
                continue
            s.position += len(t)
            s.forwards += 1
            if self.settings.trace:
                s.traces.append(cache.kept_positions(i))
        return logits

    def _attended(self, seqs: list[Sequence], phase: Phase) -> list[int] | None:
        """Under a decode-time sparsity, each lane's budget of attended keys in a decode step (prompt chunks
        attend every key)."""
        if self.policy.sparsity is None or phase is not Phase.decode:
            return None
        budgets = [s.budget_tokens for s in seqs if s.budget_tokens is not None]
        assert len(budgets) == len(seqs), "every sequence has a budget under a sparsity (Policy.budgeted)"
        return budgets

    def _admit(self, seq: Sequence) -> None:
        """Prefill one prompt (its chunks, or its copy of a shared context, then the suffix) and give the sequence
        a lane of the batch."""
        lane = len(self.live)
        cache = self._prompt_cache([seq.plans], seq, (Phase.prefill, Phase.decode))
        request = seq.request
        seq.t0 = measure.now(self.device)
        key = request.context_id
        if key is None:
            logits = self._prefill(cache, seq)
        else:
            context = self.contexts.take(key)
            seq.prefill_shared = context is not None
            if context is None:
                own = self._prompt_cache(self.contexts.plans[key], seq, (Phase.prefill,))
                context = Prefilled.of(own, seq, self._prefill(own, seq))
                self.contexts.keep(key, context)
            logits = context.start(seq, cache)
        if request.suffix_ids:
            logits = self.forward(cache, [seq], [list(request.suffix_ids)], Phase.prefill, False)  # never evicted
        seq.prefill_s = measure.now(self.device) - seq.t0
        seq.take(logits[0], keep_logits=self.settings.return_logits)
        seq.ttft_s = measure.now(self.device) - seq.t0
        seq.peak_prefill = measure.peak_memory_bytes(self.device)
        if self.batch is None:
            seq.cache = cache
        else:
            self.batch.copy_lane(cache, 0, lane)
            seq.cache = self.batch
            del cache
            if self.device.type == "cpu":  # the prompt's working memory goes back to the system, not to the heap
                measure.trim_freed_memory(collect=False)
        seq.lane = lane
        self.live.append(seq)
        self._retire([seq] if seq.stopped(self.stops, self.tokenizer) else [])

    def _prompt_cache(self, plan_sets: list[list[LayerPlan]], seq: Sequence, phases: tuple[Phase, ...]) -> KVCache:
        """A one-lane cache for a prompt (and, at batch 1, its decode), holding ``seq``'s plans."""
        cache = KVCache(
            plan_sets,
            self.policy,
            lanes=1,
            phases=phases if self.batch is None else (Phase.prefill,),
            seed=seq.request.settings.seed,
            device=self.device,
            model=self.model,
        )
        cache.assign(0, seq.plans)
        return cache

    def _prefill(self, cache: KVCache, seq: Sequence) -> torch.Tensor:
        evicts, channels = self.stage.evicts_in(Phase.prefill), self.policy.channels is not None
        return prefill_context(self.forward, cache, seq, evicts, self.settings.trace, channels)

    def _decode_step(self) -> None:
        seqs = self.live
        cache = self.batch if self.batch is not None else seqs[0].cache
        assert cache is not None, "a live sequence is in a cache"
        t = measure.now(self.device)
        fed = [[s.tokens[-1]] for s in seqs]
        logits = self.forward(cache, seqs, fed, Phase.decode, self.stage.evicts_in(Phase.decode))
        greedy = None
        if all(not s.request.settings.do_sample and not s.request.forced_tokens for s in seqs):
            greedy = logits.argmax(dim=-1).tolist()
        for i, s in enumerate(seqs):
            s.take(logits[i], None if greedy is None else greedy[i], self.settings.return_logits)
        dt = measure.now(self.device) - t
        for s in seqs:
            s.latencies.append(dt)
            s.step_batches.append(len(seqs))
        self._retire([s for s in seqs if s.stopped(self.stops, self.tokenizer)])

    def _retire(self, done: list[Sequence]) -> None:
        """Finish ``done`` and close the batch's gaps: the last live sequence moves into a freed lane."""
        for seq in sorted(done, key=lambda s: -s.lane):
            peak = measure.peak_memory_bytes(self.device)
            generation = finished_generation(seq, self.tokenizer, self.stage, self.windows, self.batch_size, peak)
            self.finished.append((seq.index, generation))
            last = self.live[-1]
            if last is not seq:
                assert self.batch is not None, "two live sequences share the batch's cache"
                self.batch.copy_lane(self.batch, last.lane, seq.lane)
                self.live[seq.lane] = last
                last.lane = seq.lane
            self.live.pop()
            seq.cache = None
