"""Prefill time and peak memory of every policy's prompt compression against ``full`` (``bench_engine.py
--prefill``): budget 0.25, stage prefill, one prompt per context, in one chunk or in chunks of ``--strides``.

In each of ``--prefill-repeats`` rounds every policy prefills the same prompt in turn, the order rotating
round by round, so that a slow spell of the machine lands on all of them alike; a figure is the median over
rounds. Peak memory is measured on the same runs: on CUDA ``max_memory_allocated`` above what was allocated
before; on CPU the peak resident set above the level before the run, sampled every millisecond, after glibc's
allocator has handed every freed page back to the system (``malloc_trim``), so that memory an earlier run freed
but kept cannot hide a later run's peak.
"""

from __future__ import annotations

import statistics
from typing import Any

from kvbench.engine.engine import DecodeSettings, Engine, EngineSettings, Request
from kvbench.engine.measure import PeakMemory
from kvbench.models import LoadedModel

POLICIES = [
    "full",
    "h2o",
    "scissorhands",
    "roco",
    "mean_window",
    "accumulated_robust",
    "vatp",
    "tova",
    "snapkv",
    "pyramidkv",
    "adakv",
]
BUDGET = 0.25


def prefill_run(lm: LoadedModel, ids: list[int], policy: Any, stride: int | None) -> tuple[float, int]:
    """(prefill seconds, peak bytes above the level before) of one prompt compression."""
    # The tokenizer: a replaying score (KVzip) words its passes' instruction with it, as a run does.
    engine = Engine(lm.model, lm.tokenizer, EngineSettings(policy, BUDGET, stride=stride))
    with PeakMemory(lm.device) as memory:
        (g,) = engine.run([Request(ids, settings=DecodeSettings(max_new_tokens=1))])
    return g.measures.timings.prefill_s, memory.peak


def prefill_table(
    lm: LoadedModel,
    policy_of: Any,
    prompt_of: Any,
    contexts: list[int],
    strides: list[int],
    repeats: int,
    names: list[str],
) -> dict[str, Any]:
    """{chunking: {context: {policy: {"s", "x_full", "peak_mb"}}}}; ``policy_of(name)`` builds a policy,
    ``prompt_of(n)`` gives an n-token prompt; stride 0 is one chunk."""
    lm.model.generation_config.eos_token_id = None
    warm = prompt_of(256)
    for name in names:  # every code path once, so that no first run pays for the allocator's growth
        built = policy_of(name)  # a score reading the whole prompt's queries takes it in one chunk
        prefill_run(lm, warm, built, None if built.whole_prompt else 128)
    table: dict[str, Any] = {"budget": BUDGET}
    for stride in strides:
        chunking = f"chunks of {stride}" if stride else "one chunk"
        table[chunking] = {}
        for n in contexts:
            ids = prompt_of(n)
            runs: dict[str, list[tuple[float, int]]] = {name: [] for name in names}
            for round_ in range(repeats):
                for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                    runs[name].append(prefill_run(lm, ids, policy_of(name), stride or None))
                    s, peak = runs[name][-1]
                    print(f"prefill {chunking} @ {n}: {name:>18} {s:7.2f} s, peak {peak / 2**20:7.0f} MiB", flush=True)
            full = statistics.median(s for s, _ in runs["full"])
            table[chunking][n] = {
                name: {
                    "s": statistics.median(s for s, _ in r),
                    "x_full": statistics.median(s for s, _ in r) / full,
                    "peak_mb": statistics.median(p for _, p in r) / 2**20,
                }
                for name, r in runs.items()
            }
    return table


def prefill_markdown(table: dict[str, Any], model: str) -> str:
    """One table per chunking: seconds (× full) and peak MiB above baseline, per policy and context."""
    lines = []
    for chunking, per_context in table.items():
        if not chunking.startswith(("one chunk", "chunks of")):
            continue
        contexts = list(per_context)
        lines += [
            "",
            f"{model}, prefill {chunking}, budget {table['budget']}: seconds (× full), peak MiB above baseline",
            "",
            "| policy | " + " | ".join(f"{n} tokens" for n in contexts) + " |",
            "| --- |" + " --- |" * len(contexts),
        ]
        for name in per_context[contexts[0]]:
            cells = [per_context[n][name] for n in contexts]
            lines.append(
                f"| {name} | "
                + " | ".join(f"{c['s']:.2f} ({c['x_full']:.2f}), {c['peak_mb']:.0f} MiB" for c in cells)
                + " |"
            )
    return "\n".join(lines)
