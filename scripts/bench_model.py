"""kvbench against transformers' ``generate`` on one model, and every named policy's decode step, interleaved.

    python scripts/bench_model.py --model gemma3-270m                 # docs/perf/gemma3-270m.md's figures
    python scripts/bench_model.py --model smollm2-135m --context 1024

The overhead comparison alternates whole runs of ``generate`` and of kvbench's full cache (median of
``--repeats``); the per-policy figures interleave the compared runs step by step (see bench_engine.py), so a
slow spell of a shared machine lands on all of them alike. Prefill per policy: ``bench_engine.py --prefill``.
CPU here, CUDA when present.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import MODELS, available, hf_generate_times, interleaved_step_ms, kvbench_times, prompt_ids  # noqa: E402

from kvbench.models import load_model  # noqa: E402

POLICIES = ["window", "streamingllm", "h2o", "tova", "roco", "snapkv", "pyramidkv", "adakv"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m", choices=sorted(MODELS))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=256, help="tokens, for the per-policy runs (stage both)")
    ap.add_argument("--new-tokens", type=int, default=33)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="results/bench_model")
    args = ap.parse_args()

    lm = load_model(args.model, **MODELS[args.model])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ids = prompt_ids(lm, args.context)
    kvbench_times(lm, ids[:64], "full", 1.0, "prefill", 4)  # warm-up
    hf_generate_times(lm, ids[:64], 4)
    hf, kv = [], []
    for _ in range(args.repeats):
        hf.append(hf_generate_times(lm, ids, args.new_tokens))
        kv.append(kvbench_times(lm, ids, "full", 1.0, "prefill", args.new_tokens))
    report = {
        "model": args.model,
        "device": str(lm.device),
        "dtype": str(lm.dtype),
        "context": args.context,
        "hf_attention": lm.model.config._attn_implementation,
        "hf_prefill_s": statistics.median(p for p, _ in hf),
        "kvbench_prefill_s": statistics.median(p for p, _ in kv),
        "hf_decode_ms": 1e3 * statistics.median(s for _, s in hf),
        "kvbench_decode_ms": 1e3 * statistics.median(s for _, s in kv),
    }
    print(json.dumps(report, indent=1))

    runs = {"full": ("full", 1.0, "prefill", ids)}
    runs |= {
        name: (name, args.budget, "both", ids)
        for name in available(POLICIES)
        if name not in ("snapkv", "pyramidkv", "adakv")
    }
    runs |= {f"{name} (prefill)": (name, args.budget, "prefill", ids) for name in available(POLICIES)}
    per_policy = interleaved_step_ms(lm, runs, args)
    report["policy_ms"] = per_policy
    lines = [
        f"{args.model} on {report['device']} ({report['dtype']}), {args.context}-token prompt",
        "",
        "| | transformers generate | kvbench full | ratio |",
        "| --- | --- | --- | --- |",
        f"| prefill s | {report['hf_prefill_s']:.3f} | {report['kvbench_prefill_s']:.3f} | "
        f"{report['hf_prefill_s'] / report['kvbench_prefill_s']:.2f} |",
        f"| decode ms/token | {report['hf_decode_ms']:.2f} | {report['kvbench_decode_ms']:.2f} | "
        f"{report['hf_decode_ms'] / report['kvbench_decode_ms']:.2f} |",
        "",
        f"| policy (budget {args.budget}) | decode ms/token |",
        "| --- | --- |",
    ]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in per_policy.items()]
    (out / f"bench_model_{args.model}.json").write_text(json.dumps(report, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
