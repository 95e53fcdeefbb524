"""Batched decoding and what the memory saved buys: SmolLM2 float32 by default, 1k-token prompts, 64 new tokens.

    python scripts/bench_batch.py                    # docs/perf/batch.md (about 25 minutes on 2 CPU cores)
    python scripts/bench_batch.py --model tiny-llama --context 128 --new-tokens 8 --rounds 1 --out /tmp/b  # seconds
    python scripts/bench_batch.py --device cuda --out /tmp/b    # the same on a GPU
    python scripts/bench_batch.py --parts capacity   # one part; the others keep their figures from the JSON

Every compared figure comes from runs interleaved in one process, the order rotating round by round, so a slow
spell of the machine lands on all of them alike; a figure is the median over ``--rounds``.

- Throughput: decode tokens/s of ``full`` at batch 1 and 8 against transformers' ``generate`` at the same batch
  (left-padded; its decode time is a 64-token run minus a 1-token run, per token).
- Per-step cost at batch 8 of the attention-statistics policies against ``window`` (budget 0.25, stage both).
- Capacity: the memory cap is set halfway between what 4 and 5 full-cache sequences take, so ``full`` fits 4;
  then ``kvbench.capacity.largest_batch`` finds each policy's largest batch under it (budget 0.25, stage both),
  and its decode tokens/s there is measured against ``full``'s at 4.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvbench.capacity import GIB, largest_batch, probe
from kvbench.engine import measure
from kvbench.engine.engine import DecodeSettings, Engine, EngineSettings, Request
from kvbench.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import MODELS, policy  # noqa: E402

STATS = ["h2o", "roco", "tova", "scissorhands", "mean_window", "accumulated_robust", "vatp"]
CAPACITY = ["window", "h2o", "roco"]
PARTS = ("throughput", "steps", "capacity")


def prompts(vocab: int, n: int, count: int, new: int) -> list[Request]:
    g = torch.Generator().manual_seed(n)
    return [
        Request(
            torch.randint(100, min(vocab, 20000), (n,), generator=g).tolist(),
            settings=DecodeSettings(max_new_tokens=new),
        )
        for _ in range(count)
    ]


def kvbench_step(model: Any, reqs: list[Request], name: str, budget: float, stage: str) -> float:
    """Median seconds of a decode step while every sequence of the batch is live."""
    gens = Engine(model, None, EngineSettings(policy(name), budget, stage, len(reqs))).run(reqs)
    return statistics.median(gens[0].decode_latencies_s)


def generate_step(model: Any, reqs: list[Request], new: int) -> float:
    """transformers' generate, greedy, left-padded batch: seconds per decode step."""
    ids = torch.tensor([r.input_ids for r in reqs], device=model.device)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        t = measure.now(model.device)
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return measure.now(model.device) - t

    return (run(new) - run(1)) / (new - 1)


def interleaved(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each run once per round, the order rotating; the median per run."""
    out: dict[str, list[float]] = {k: [] for k in runs}
    labels = list(runs)
    for r in range(rounds):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            out[label].append(runs[label]())
            print(f"  {label}: {out[label][-1] * 1e3:.1f} ms/step", flush=True)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("docs/perf"))
    ap.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: CUDA when torch sees it)")
    ap.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="parts to run; a part not run keeps its figures from the JSON already in --out (if any)",
    )
    args = ap.parse_args()
    lm = load_model(args.model, **MODELS[args.model], dtype="float32", device=args.device)
    model = lm.model
    model.generation_config.eos_token_id = None  # exactly new_tokens every run
    model.generation_config.pad_token_id = 0
    vocab, b = model.config.vocab_size, args.batch
    one, many = prompts(vocab, args.context, 1, args.new_tokens), prompts(vocab, args.context, b, args.new_tokens)
    path = args.out / f"bench_batch_{args.model}.json"
    settings: dict[str, Any] = {
        "model": args.model,
        "context": args.context,
        "new_tokens": args.new_tokens,
        "batch": b,
        "budget": args.budget,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "device": str(lm.device),
    }
    report: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    keys = {"throughput": "throughput_tokens_per_s", "steps": "step_ms", "capacity": "capacity"}
    earlier = {k: report.get(k) for k in settings}
    measured_with = report.setdefault(  # a part kept from an earlier run keeps the settings it was measured with
        "settings_by_part", {part: earlier for part, key in keys.items() if key in report}
    )
    report.update(settings)
    if "throughput" in args.parts:
        report["throughput_tokens_per_s"] = throughput(model, one, many, args)
    if "steps" in args.parts:
        report["step_ms"] = step_costs(model, many, args)
    if "capacity" in args.parts:
        report["capacity"] = capacity(model, prompts(vocab, args.context, 4, args.new_tokens), args)
    measured_with.update({part: settings for part in args.parts})
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"wrote {path}")


def throughput(model: Any, one: list[Request], many: list[Request], args: argparse.Namespace) -> dict[str, float]:
    """Decode tokens/s of kvbench ``full`` and transformers' generate at batch 1 and ``--batch``."""
    b = len(many)
    print("throughput", flush=True)
    steps = interleaved(
        {
            "kvbench full B=1": lambda: kvbench_step(model, one, "full", 1.0, "both"),
            f"kvbench full B={b}": lambda: kvbench_step(model, many, "full", 1.0, "both"),
            "generate B=1": lambda: generate_step(model, one, args.new_tokens),
            f"generate B={b}": lambda: generate_step(model, many, args.new_tokens),
        },
        args.rounds,
    )
    return {k: (b if f"B={b}" in k else 1) / v for k, v in steps.items()}


def step_costs(model: Any, many: list[Request], args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds per decode step at batch ``--batch`` of ``window`` and the attention-statistics policies."""
    print("per-step cost at batch", len(many), flush=True)
    runs = {
        name: (lambda name=name: kvbench_step(model, many, name, args.budget, "both")) for name in ["window"] + STATS
    }
    return {k: v * 1e3 for k, v in interleaved(runs, args.rounds).items()}


def capacity(model: Any, reqs: list[Request], args: argparse.Namespace) -> dict[str, Any]:
    """The cap halfway between what 4 and 5 full-cache sequences take; each policy's largest batch under it and
    its decode tokens/s there."""
    print("capacity", flush=True)
    sizes = {n: probe(model, reqs, policy("full"), 1.0, "both", n, 1 << 62).peak_memory_bytes for n in (4, 5)}
    cap = (sizes[4] + sizes[5]) // 2
    out: dict[str, Any] = {"cap_bytes": cap, "cap_gib": cap / GIB, "full_peak_bytes": sizes, "policies": {}}
    for name in ["full"] + CAPACITY:
        budget = 1.0 if name == "full" else args.budget
        best, probes = largest_batch(
            lambda n, name=name, budget=budget: probe(model, reqs, policy(name), budget, "both", n, cap)
        )
        out["policies"][name] = {"max_batch": best, "probes": [p.row() for p in probes]}
        print(f"  {name}: max batch {best}", flush=True)
    at = {
        name: (
            lambda name=name: kvbench_step(
                model,
                [reqs[i % 4] for i in range(out["policies"][name]["max_batch"])],
                name,
                1.0 if name == "full" else args.budget,
                "both",
            )
        )
        for name in ["full"] + CAPACITY
    }
    for name, step in interleaved(at, args.rounds).items():
        out["policies"][name]["decode_tokens_per_s"] = out["policies"][name]["max_batch"] / step
    return out


def setting(report: dict[str, Any], part: str, key: str) -> Any:
    """A run setting of ``part``, as it was when that part was measured."""
    return report.get("settings_by_part", {}).get(part, report)[key]


def markdown(report: dict[str, Any]) -> str:
    lines: list[str] = []
    tps = report.get("throughput_tokens_per_s")
    if tps:
        b = setting(report, "throughput", "batch")
        lines += [
            "| decode tokens/s | kvbench full | transformers generate | kvbench / generate |",
            "| --- | --- | --- | --- |",
        ]
        for n in (1, b):
            ours, theirs = tps[f"kvbench full B={n}"], tps[f"generate B={n}"]
            lines.append(f"| batch {n} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f} |")
        lines.append(
            f"\nkvbench full, batch {b} / batch 1: {tps[f'kvbench full B={b}'] / tps['kvbench full B=1']:.2f} ×\n"
        )
    steps = report.get("step_ms")
    if steps:
        budget, b = setting(report, "steps", "budget"), setting(report, "steps", "batch")
        lines += [f"| policy (budget {budget}, batch {b}) | decode step ms | × window |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v:.1f} | {v / steps['window']:.2f} |" for k, v in steps.items()]
    cap = report.get("capacity")
    if not cap:
        return "\n".join(lines)
    full = cap["policies"]["full"]
    measured = "device" if "cuda" in report["device"] else "KV + working, CPU RSS"
    lines += [
        f"\nMemory cap {cap['cap_gib'] * 1024:.0f} MiB ({measured})\n",
        "| policy | max batch | × full | decode tokens/s there | × full |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, p in cap["policies"].items():
        lines.append(
            f"| {name} | {p['max_batch']} | {p['max_batch'] / full['max_batch']:.2f} | "
            f"{p['decode_tokens_per_s']:.1f} | {p['decode_tokens_per_s'] / full['decode_tokens_per_s']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
