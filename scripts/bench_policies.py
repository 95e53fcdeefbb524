#!/usr/bin/env python
"""Per-step decode time of every named policy against ``window`` and ``full``, at several context lengths.

    .venv/bin/python scripts/bench_policies.py                       # 1k, 2k, 4k on SmolLM2-135M
    .venv/bin/python scripts/bench_policies.py --contexts 256 512 --steps 8 --repeats 2   # a quick look

Each (policy, context) cell: one warm-up run, then ``--repeats`` timed runs; a run teacher-forces
``--steps`` decode steps (identical work for every policy) and the cell reports the median over runs of
each run's median step latency. ``--stage both`` (default) compresses the prompt to the budget and then
holds it while decoding, evicting at every step, so the time includes the policy's statistics and
selection; policies that cannot run in a stage are run in ``both`` and marked. Resident KV bytes come
from the cache's tensors at the end of the run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvbench.engine.engine import DecodeSettings, Engine, EngineSettings, Request  # noqa: E402
from kvbench.models import load_model  # noqa: E402
from kvbench.policies.registry import build_policy  # noqa: E402

POLICY_DIR = REPO / "configs" / "policy"


def named_policies(names: list[str] | None) -> dict[str, dict]:
    available = sorted(p.stem for p in POLICY_DIR.glob("*.yaml"))
    chosen = names or available
    unknown = sorted(set(chosen) - set(available))
    if unknown:
        raise SystemExit(f"unknown policy {', '.join(unknown)}; choose from {', '.join(available)}")
    order = ["full", "window"] + [n for n in chosen if n not in ("full", "window")]
    return {n: OmegaConf.to_container(OmegaConf.load(POLICY_DIR / f"{n}.yaml"), resolve=True) for n in order}


def time_cell(lm, policy, ids, forced, budget, stage, stride, repeats: int) -> dict:
    def once():
        t0 = time.perf_counter()
        engine = Engine(lm.model, lm.tokenizer, EngineSettings(policy, budget, stage, stride=stride))
        (g,) = engine.run([Request(ids, settings=DecodeSettings(max_new_tokens=len(forced)), forced_tokens=forced)])
        return g, time.perf_counter() - t0

    once()  # warm-up
    runs = [once() for _ in range(repeats)]
    per_run = [statistics.median(g.decode_latencies_s) for g, _ in runs]
    g = runs[-1][0]
    return {
        "step_ms": 1000 * statistics.median(per_run),
        "step_ms_spread": 1000 * (max(per_run) - min(per_run)),
        "prefill_s": statistics.median(r[0].measures.timings.prefill_s for r in runs),
        "resident_kib": g.measures.kv_resident_bytes / 1024,
        "kept": g.measures.kept_tokens,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--steps", type=int, default=32, help="decode steps per run")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per cell (after one warm-up)")
    ap.add_argument("--budget", type=float, default=0.5, help="a fraction of the prompt (or an integer count)")
    ap.add_argument("--stage", default="both", choices=["prefill", "decode", "both"])
    ap.add_argument("--stride", type=int, default=None, help="prefill chunk (default: the whole prompt)")
    ap.add_argument("--policies", nargs="*", default=None, help="named policies (default: every config)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    budget = int(args.budget) if args.budget > 1 else args.budget
    lm = load_model(
        args.model,
        source="embedded" if args.model == "smollm2-135m" else "pretrained",
        name_or_path=None if args.model == "smollm2-135m" else args.model,
        dtype=args.dtype,
        device=args.device,
    )
    policies = named_policies(args.policies)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = lm.model.config.vocab_size
    print(
        f"model={args.model} device={lm.device} dtype={lm.dtype} threads={torch.get_num_threads()} "
        f"stage={args.stage} budget={args.budget} steps={args.steps} repeats={args.repeats} (+1 warm-up)"
    )
    header = (
        f"{'policy':<20}{'context':>8}{'ms/step':>10}{'±':>7}{'vs window':>11}{'vs full':>9}"
        f"{'prefill s':>11}{'KV KiB':>10}"
    )
    for context in args.contexts:
        ids = torch.randint(0, vocab, (context,), generator=gen).tolist()
        forced = torch.randint(0, vocab, (args.steps + 1,), generator=gen).tolist()
        print()
        print(header)
        cells: dict[str, dict] = {}
        printed: list[str] = []
        for name, cfg in policies.items():
            policy = build_policy(cfg)
            stage = args.stage if args.stage not in policy.unsupported_stages else "both"
            cells[name] = time_cell(lm, policy, ids, forced, budget, stage, args.stride, args.repeats)
            cells[name]["note"] = "" if stage == args.stage else f"  (stage={stage})"
            if "full" in cells and "window" in cells:  # both references are in: print what is ready
                for ready in [n for n in cells if n not in printed]:
                    cell = cells[ready]
                    print(
                        f"{ready:<20}{context:>8}{cell['step_ms']:>10.2f}{cell['step_ms_spread']:>7.2f}"
                        f"{cell['step_ms'] / cells['window']['step_ms']:>10.2f}x"
                        f"{cell['step_ms'] / cells['full']['step_ms']:>8.2f}x"
                        f"{cell['prefill_s']:>11.3f}{cell['resident_kib']:>10.0f}{cell['note']}",
                        flush=True,
                    )
                    printed.append(ready)


if __name__ == "__main__":
    main()
