"""How the batch loop feeds a prompt's context into its cache: in chunks, then the replay passes a policy reads
(KVzip, KVgrad), or the context twice where the score re-reads it (KVCompose)."""

from __future__ import annotations

from typing import Protocol

import torch

from kvbench.engine.cache.cache import KVCache
from kvbench.engine.sequence import Sequence
from kvbench.engine.step import Reconstruction
from kvbench.stages import Phase


class Forward(Protocol):
    """The batch loop's one forward of lanes ``0:len(seqs)`` (``BatchLoop.forward``): the last logits [B, V]."""

    def __call__(
        self,
        cache: KVCache,
        seqs: list[Sequence],
        ids: list[list[int]],
        phase: Phase,
        evicts: bool,
        replay: Reconstruction | None = None,
    ) -> torch.Tensor: ...


def prefill_context(
    forward: Forward, cache: KVCache, seq: Sequence, evicts: bool, trace: bool, channels: bool
) -> torch.Tensor:
    """Feed the prompt's context in chunks, evicting where the stage does (``evicts``; after its replay passes,
    where the policy replays it); the last position's logits. Under pruned key channels (``channels``, ThinK)
    they are chosen once the context is in."""
    ids = seq.request.input_ids
    logits = reread_context(forward, cache, seq, trace) if seq.rereads else None
    for start in range(0, len(ids) if logits is None else 0, seq.chunk):
        chunk = [ids[start : start + seq.chunk]]
        logits = forward(cache, [seq], chunk, Phase.prefill, evicts and not seq.replays)
    assert logits is not None, "a prompt has at least one chunk"
    for i, (span, replayed) in enumerate(seq.replays):  # KVzip's passes: the last one evicts
        forward(cache, [seq], [replayed], Phase.prefill, evicts and i == len(seq.replays) - 1, span)
    if channels:
        cache.prune_channels()
    seq.kept_after_prefill = cache.summary(0).kept_per_layer
    return logits


def reread_context(forward: Forward, cache: KVCache, seq: Sequence, trace: bool) -> torch.Tensor:
    """KVCompose's observation pass (``Score.rereads``): the context is fed, then fed again after itself, and
    the second pass's attention scores the first pass's entries in its eviction, which drops the second pass's
    own (the score ranks them last, below any budget). The sequence then goes on from the context's end, as
    if it had been fed once: one forward, one trace, the first pass's logits."""
    ids = list(seq.request.input_ids)
    logits = forward(cache, [seq], [ids], Phase.prefill, False)
    forward(cache, [seq], [ids], Phase.prefill, True)
    held = cache.kept_positions(0)
    if any(bool((layer >= len(ids)).any()) for layer in held):
        raise RuntimeError("the re-read pass's own entries outlived its eviction")
    seq.position -= len(ids)
    seq.forwards -= 1
    if trace:
        del seq.traces[-2]
    return logits
