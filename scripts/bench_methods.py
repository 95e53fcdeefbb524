#!/usr/bin/env python
"""What the methods of 2024–26 cost against the baselines they replace, on SmolLM2 (docs/perf/methods.md).

    .venv/bin/python scripts/bench_methods.py                         # every part, about 30 minutes on 2 cores
    .venv/bin/python scripts/bench_methods.py --parts decode1 --methods keydiff lagkv --repeats 1
    .venv/bin/python scripts/bench_methods.py --model tiny-llama --context 256 --batch-context 64 \
        --prefill-contexts 256 --new-tokens 6 --repeats 1 --out /tmp/bench        # seconds, a smoke run

Parts (``--parts``), each a set of runs interleaved in this one process, so that a slow spell of a shared machine
lands on every run alike:

- ``decode1``: the median decode step at batch 1 after a ``--context``-token prompt, budget 0.25, against
  ``window`` in the same stage: ``both`` (the prompt compressed, then the budget held while decoding) for a
  method that evicts in decode, ``prefill`` (the compressed prompt plus what is generated) for one that only
  compresses a prompt.
- ``decode8``: the same at batch ``--batch`` after ``--batch-context``-token prompts.
- ``prefill``: one prompt compression (stage prefill, budget 0.25, one chunk) of ``--prefill-contexts`` tokens
  against ``full``'s prefill of the same prompt.
- ``interval``: the mean decode step over 2 × ``--interval`` + 1 steps of the attention-statistics policies
  evicting every ``--interval`` decode steps (stage both), against ``window`` evicting at every step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from kvbench.models import load_model
from kvbench.policies.registry import build_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batch import interleaved, kvbench_step, prompts  # noqa: E402
from bench_engine import CONFIGS, MODELS, STATISTICS_POLICIES, available, interleaved_step_ms, policy, prompt_ids
from prefill_bench import prefill_table

METHODS = [
    "keydiff",
    "lagkv",
    "expected_attention",
    "criticalkv",
    "criticalkv_adakv",
    "chunkkv",
    "leverage",
    "noncausal_attn",
    "compactor",
    "cur",
    "cap",
    "rkv",
    "threshold",
    "cam",
]
# The methods that decide per layer, per head, per channel or by passes of their own (docs/perf/methods_ii.md).
METHODS_II = [
    "snapkv",
    "global_snapkv",
    "layers_snapkv",
    "simlayerkv",
    "kvzip",
    "kvzip_plus",
    "kvgrad",
    "kvcompose",
    "duoattention",
    "cake",
    "entropy_gated_chunkkv",
    "think",
    "think_snapkv",
    "quest",
]
PARTS = ("decode1", "decode8", "prefill", "interval")
BUDGET = 0.25


def stage_of(name: str) -> str:
    """``both`` where the method evicts in decode, else ``prefill`` (the compressed prompt, then decoding), and
    ``decode`` for a method that only runs there (Quest attends its budget of a full prompt's keys)."""
    refused = policy(name).unsupported_stages
    return next(stage for stage in ("both", "prefill", "decode") if stage not in refused)


def with_interval(name: str, interval: int) -> Any:
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIGS / "policy" / f"{name}.yaml"), resolve=True)
    return build_policy(cfg | {"interval": interval})


def decode_batch1(lm: Any, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    ctx = prompt_ids(lm, args.context)
    stages = ("both", "prefill", "decode")
    runs = {f"window ({stage})": ("window", BUDGET, stage, ctx) for stage in stages if stage in map(stage_of, names)}
    runs |= {name: (name, BUDGET, stage_of(name), ctx) for name in names}
    ms = interleaved_step_ms(lm, runs, args)
    return {
        label: {"ms": v, "x_window": v / ms[f"window ({runs[label][2]})"], "stage": runs[label][2]}
        for label, v in ms.items()
    }


def decode_batched(lm: Any, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    reqs = prompts(lm.model.config.vocab_size, args.batch_context, args.batch, args.new_tokens)
    used = {stage_of(n) for n in names}
    stages = {f"window ({s})": ("window", s) for s in ("both", "prefill", "decode") if s in used}
    stages |= {n: (n, stage_of(n)) for n in names}
    runs = {label: (lambda n=n, s=s: kvbench_step(lm.model, reqs, n, BUDGET, s)) for label, (n, s) in stages.items()}
    seconds = interleaved(runs, args.repeats)
    return {
        label: {"ms": v * 1e3, "x_window": v / seconds[f"window ({stages[label][1]})"], "stage": stages[label][1]}
        for label, v in seconds.items()
    }


def statistics_interval(lm: Any, args: argparse.Namespace) -> dict[str, Any]:
    ctx = prompt_ids(lm, args.context)
    names = available(STATISTICS_POLICIES)
    runs: dict[str, tuple[Any, float, str, list[int]]] = {"window": ("window", BUDGET, "both", ctx)}
    runs |= {f"{n} interval={args.interval}": (with_interval(n, args.interval), BUDGET, "both", ctx) for n in names}
    # The mean, not the median: most steps of an interval evict nothing, and the one that does is the cost.
    steps = argparse.Namespace(**(vars(args) | {"new_tokens": 2 * args.interval + 1}))
    ms = interleaved_step_ms(lm, runs, steps, reduce=statistics.mean)
    return {label: {"ms": v, "x_window": v / ms["window"]} for label, v in ms.items()}


def markdown(report: dict[str, Any]) -> str:
    settings, parts = report["settings"], report["parts"]
    lines = [f"{settings['model']} on {settings['device']} ({settings['threads']} threads), budget {BUDGET}."]
    titles = {
        "decode1": f"Decode step at batch 1 after {settings['context']} tokens (median ms, × window, same stage)",
        "decode8": f"Decode step at batch {settings['batch']} after {settings['batch_context']} tokens (median ms)",
        "interval": f"Mean decode step over {2 * settings['interval'] + 1} steps with interval={settings['interval']} "
        "(× window evicting every step)",
    }
    for part, title in titles.items():
        if part in parts:
            lines += ["", title, "", "| run | stage | ms | × window |", "| --- | --- | ---: | ---: |"]
            for label, r in parts[part].items():
                lines.append(f"| {label} | {r.get('stage', 'both')} | {r['ms']:.1f} | {r['x_window']:.2f} |")
    if "prefill" in parts:
        per_context = parts["prefill"]["one chunk"]
        contexts = list(per_context)
        lines += ["", "Prefill, one chunk: seconds (× full), peak MiB above the level before", ""]
        lines += [
            "| method | " + " | ".join(f"{n} tokens" for n in contexts) + " |",
            "| --- |" + " ---: |" * len(contexts),
        ]
        for name in per_context[contexts[0]]:
            cells = [per_context[n][name] for n in contexts]
            shown = (f"{c['s']:.1f} ({c['x_full']:.2f}), {c['peak_mb']:.0f} MiB" for c in cells)
            lines.append(f"| {name} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--methods", nargs="+", default=METHODS, help="config names; 'ii': METHODS_II")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batch-context", type=int, default=1024)
    ap.add_argument("--prefill-contexts", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--new-tokens", type=int, default=33)
    ap.add_argument("--interval", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--stride", type=int, default=None, help="prefill chunk of the decode runs; default one chunk")
    ap.add_argument("--out", default="results/bench_methods")
    args = ap.parse_args()

    names = available(METHODS_II if args.methods == ["ii"] else args.methods)
    prefill_names = ["full"] + [n for n in names if "prefill" not in policy(n).unsupported_stages]
    lm = load_model(args.model, **MODELS[args.model])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"parts": {}}
    report["settings"] = {
        "model": args.model,
        "device": str(lm.device),
        "threads": torch.get_num_threads(),
        "context": args.context,
        "batch": args.batch,
        "batch_context": args.batch_context,
        "interval": args.interval,
    }
    for part in args.parts:
        print(f"-- {part}", flush=True)
        if part == "decode1":
            report["parts"][part] = decode_batch1(lm, names, args)
        elif part == "decode8":
            report["parts"][part] = decode_batched(lm, names, args)
        elif part == "prefill":
            report["parts"][part] = prefill_table(
                lm, policy, lambda n: prompt_ids(lm, n), args.prefill_contexts, [0], args.repeats, prefill_names
            )
        else:
            report["parts"][part] = statistics_interval(lm, args)
        (out / f"bench_methods_{args.model}.json").write_text(json.dumps(report, indent=2))
        print(markdown(report), flush=True)


if __name__ == "__main__":
    main()
