"""kvbench against transformers' ``generate`` on one model, and every named policy's decode step, interleaved.

    python scripts/bench_model.py --model gemma3-270m                 # the README's Gemma 3 270M figures
    python scripts/bench_model.py --model smollm2-135m --context 1024
    python scripts/bench_model.py --model smollm2-135m --prefill-only --prefill-contexts 4096 8192

The overhead comparison alternates whole runs of ``generate`` and of kvbench's full cache (median of
``--repeats``); the per-policy figures interleave the compared runs step by step (see bench_engine.py), so a
slow spell of a shared machine lands on all of them alike. The prefill figures run each policy's prompt
compression (budget 0.25, stage prefill) once per round, the policies in turn, and give the median over rounds
against ``full``'s. CPU here, CUDA when present.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import available, hf_generate_times, interleaved_step_ms, kvbench_times, prompt_ids  # noqa: E402

from kvbench.models import load_model  # noqa: E402

MODELS = {"smollm2-135m": {"source": "embedded", "embedded": "smollm2"},
          "gemma3-270m": {"source": "embedded", "embedded": "gemma3-270m"},
          "tiny-llama": {"source": "tiny"}}
POLICIES = ["window", "streamingllm", "h2o", "tova", "roco", "snapkv", "pyramidkv", "adakv"]
PREFILL_POLICIES = ["full", "h2o", "roco", "tova", "snapkv"]


def prefill_seconds(lm, contexts: list[int], stride: int | None, repeats: int) -> dict[str, dict[int, float]]:
    """Median prefill seconds per policy and context, the policies interleaved round by round."""
    from bench_engine import policy

    from kvbench.engine.generate import DecodeSettings, generate

    lm.model.generation_config.eos_token_id = None
    seconds: dict[str, dict[int, list[float]]] = {name: {n: [] for n in contexts} for name in PREFILL_POLICIES}
    for n in contexts:
        ids = prompt_ids(lm, n)
        generate(lm.model, None, ids[:256], policy("h2o"), 0.25, "prefill", DecodeSettings(max_new_tokens=2))
        for _ in range(repeats):
            for name in PREFILL_POLICIES:
                g = generate(lm.model, None, ids, policy(name), 0.25, "prefill", DecodeSettings(max_new_tokens=2),
                             stride=stride)
                seconds[name][n].append(g.prefill_s)
    return {name: {n: statistics.median(v) for n, v in per.items()} for name, per in seconds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m", choices=sorted(MODELS))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=256, help="tokens, for the per-policy runs (stage both)")
    ap.add_argument("--new-tokens", type=int, default=33)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stride", type=int, default=None, help="prefill chunk of the per-policy runs")
    ap.add_argument("--prefill-contexts", type=int, nargs="*", default=[])
    ap.add_argument("--prefill-only", action="store_true")
    ap.add_argument("--out", default="results/bench_model")
    args = ap.parse_args()

    lm = load_model(args.model, **MODELS[args.model])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.prefill_contexts:
        prefill = prefill_seconds(lm, args.prefill_contexts, args.stride, args.repeats)
        chunks = f"chunks of {args.stride}" if args.stride else "one chunk"
        print(f"\n| prefill s, {chunks} (× full) | " + " | ".join(str(n) for n in args.prefill_contexts) + " |")
        print("| --- |" + " --- |" * len(args.prefill_contexts))
        for name, per in prefill.items():
            print(f"| {name} | " + " | ".join(f"{per[n]:.2f} ({per[n] / prefill['full'][n]:.2f})"
                                              for n in args.prefill_contexts) + " |")
        (out / f"bench_prefill_{args.model}_{args.stride or 'one'}.json").write_text(json.dumps(prefill, indent=2))
        if args.prefill_only:
            return
    ids = prompt_ids(lm, args.context)
    kvbench_times(lm, ids[:64], "full", 1.0, "prefill", 4)  # warm-up
    hf_generate_times(lm, ids[:64], 4)
    hf, kv = [], []
    for _ in range(args.repeats):
        hf.append(hf_generate_times(lm, ids, args.new_tokens))
        kv.append(kvbench_times(lm, ids, "full", 1.0, "prefill", args.new_tokens))
    report = {
        "model": args.model, "device": str(lm.device), "dtype": str(lm.dtype), "context": args.context,
        "hf_attention": lm.model.config._attn_implementation,
        "hf_prefill_s": statistics.median(p for p, _ in hf), "kvbench_prefill_s": statistics.median(p for p, _ in kv),
        "hf_decode_ms": 1e3 * statistics.median(s for _, s in hf),
        "kvbench_decode_ms": 1e3 * statistics.median(s for _, s in kv),
    }
    print(json.dumps(report, indent=1))

    runs = {"full": ("full", 1.0, "prefill", ids)}
    runs |= {name: (name, args.budget, "both", ids) for name in available(POLICIES) if name not in ("snapkv", "pyramidkv", "adakv")}
    runs |= {f"{name} (prefill)": (name, args.budget, "prefill", ids) for name in available(POLICIES)}
    per_policy = interleaved_step_ms(lm, runs, args)
    report["policy_ms"] = per_policy
    lines = [f"{args.model} on {report['device']} ({report['dtype']}), {args.context}-token prompt",
             "", "| | transformers generate | kvbench full | ratio |", "| --- | --- | --- | --- |",
             f"| prefill s | {report['hf_prefill_s']:.3f} | {report['kvbench_prefill_s']:.3f} | "
             f"{report['hf_prefill_s'] / report['kvbench_prefill_s']:.2f} |",
             f"| decode ms/token | {report['hf_decode_ms']:.2f} | {report['kvbench_decode_ms']:.2f} | "
             f"{report['hf_decode_ms'] / report['kvbench_decode_ms']:.2f} |",
             "", f"| policy (budget {args.budget}) | decode ms/token |", "| --- | --- |"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in per_policy.items()]
    (out / f"bench_model_{args.model}.json").write_text(json.dumps(report, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
