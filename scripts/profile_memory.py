"""Memory check: profiling a long prompt (SmolLM2, 8k tokens by default) peaks within a chunk-sized margin of a
plain prefill of the same prompt. Each measurement runs in a fresh process (the peak RSS only grows); the peak
above the RSS after loading the model is compared. Usage: python scripts/profile_memory.py [--tokens 8192]."""

from __future__ import annotations

import argparse
import functools
import json
import resource
import subprocess
import sys

CONTINUATION = 16


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(mode: str, tokens: int) -> dict[str, float]:
    import torch

    from kvbench.families import layer_windows
    from kvbench.models import load_model
    from kvbench.profile.collect import record
    from kvbench.profile.consistency import bare_scores, layer_budgets
    from kvbench.profile.summary import layer_result

    lm = load_model("smollm2-135m", source="embedded", dtype="float32", device="cpu")
    ids = torch.randint(100, 20000, (tokens + CONTINUATION,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        lm.model(input_ids=torch.tensor([ids[:64]]), use_cache=False, logits_to_keep=1)  # warm up
    loaded = peak_mib()
    if mode == "plain":  # the model's own SDPA prefill of the prompt, with its cache
        with torch.inference_mode():
            lm.model(input_ids=torch.tensor([ids[:tokens]]), use_cache=True, logits_to_keep=1)
    else:  # the profile and the consistency of every score, as kvbench-profile runs them
        scores = bare_scores()
        budgets = layer_budgets(scores, [0.05, 0.1, 0.2, 0.3, 0.5, 0.75], tokens, layer_windows(lm.model.config))
        on_layer = functools.partial(layer_result, candidates=scores, budgets=budgets)
        record(lm.model, ids[:tokens], ids[tokens:], on_layer)
    return {"loaded_mib": loaded, "peak_mib": peak_mib(), "above_loaded_mib": peak_mib() - loaded}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--mode", choices=("plain", "profile"))
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(measure(args.mode, args.tokens)))
        return
    from kvbench.engine.blocked import STATS_BLOCK_ELEMENTS

    found = {}
    for mode in ("plain", "profile"):
        cmd = [sys.executable, __file__, "--mode", mode, "--tokens", str(args.tokens)]
        found[mode] = json.loads(
            subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
        )
    margin = found["profile"]["above_loaded_mib"] - found["plain"]["above_loaded_mib"]
    block_mib = STATS_BLOCK_ELEMENTS * 4 / 2**20
    print(json.dumps({"tokens": args.tokens, **found, "margin_mib": margin, "block_mib": block_mib}, indent=1))


if __name__ == "__main__":
    main()
