"""The engine's one entry point: ``Engine(model, tokenizer, settings)``, then ``run(requests)`` for every
request's ``Generation``, or ``steps(requests)`` to advance them one unit of work at a time.

A unit of work is one prompt's prefill or one decode step of the batch (``engine.batch``). Pausing between units
lets a benchmark interleave the units of several runs, so that a slow spell of a shared machine lands on all of
them alike (the device's peak-memory counters are then shared by those runs), and lets the runner score each
sequence as soon as it is done.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvbench.engine import allocator
from kvbench.engine.attention import kvbench_attention_enabled
from kvbench.engine.batch import BatchLoop, Finished
from kvbench.engine.fused_llama import fused_forward_for
from kvbench.engine.plan import layers_problem
from kvbench.engine.sampling import DecodeSettings
from kvbench.engine.sequence import Generation, Request
from kvbench.engine.settings import EngineSettings
from kvbench.families import check_supported, layer_windows

__all__ = ["DecodeSettings", "Engine", "EngineSettings", "Finished", "Generation", "Request"]


class Engine:
    """A model run under ``settings``. The model is checked once, here; each ``run`` or ``steps`` call starts
    from empty caches, so an engine serves any number of request lists."""

    def __init__(self, model: Any, tokenizer: Any, settings: EngineSettings):
        check_supported(model.config)
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.windows = layer_windows(model.config)
        problem = layers_problem(settings.policy, self.windows)
        if problem:
            raise ValueError(problem)
        if next(model.parameters()).device.type == "cpu":
            allocator.map_large_blocks_alone()
        self.fused = fused_forward_for(model, settings.fused)
        if self.fused is not None:
            self.fused.pack(settings.batch_size)

    def steps(self, requests: list[Request]) -> Iterator[list[Finished]]:
        """One unit of work per item; each item lists the requests it finished: their index, and their
        generation or the error that ended them (a request that cannot run, or a unit of work that failed; the
        other requests go on)."""
        loop = BatchLoop(self.model, self.tokenizer, self.settings, self.windows, self.fused, requests)
        while not loop.done:
            yield loop.step()

    def run(self, requests: list[Request]) -> list[Generation]:
        """Every request's ``Generation``, in request order; the first error of any is raised."""
        out: list[Generation | None] = [None] * len(requests)
        with kvbench_attention_enabled(self.model):  # held for the whole run, not set again at every step
            for finished in self.steps(requests):
                for index, result in finished:
                    if isinstance(result, Exception):
                        raise result
                    out[index] = result
        assert all(g is not None for g in out), "every request finishes"
        return [g for g in out if g is not None]
