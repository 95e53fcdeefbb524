"""Two revisions of kvbench, benchmarked turn about on this machine: did a change make the engine slower?

    python scripts/bench_versions.py BASE_REV                 # BASE_REV against the working tree
    python scripts/bench_versions.py BASE_REV --head HEAD_REV --rounds 2
    python scripts/bench_versions.py BASE_REV --model tiny-llama --quick     # seconds, to try the script

Each revision runs its own ``bench_engine.py`` (batch-1 decode against transformers' ``generate``, each policy's
decode step against ``window``), ``bench_engine.py --prefill`` (prefill against ``full`` at 4k and 8k tokens) and
``bench_batch.py --parts throughput steps`` (batch 8), in separate processes that alternate between the revisions
(base, head, head, base, ...), so a slow spell of the machine does not land on one revision only. The figures
compared are ratios measured inside one process (kvbench against ``generate``, a policy against ``window`` or
``full``), which a drifting machine moves far less than absolute times. Nothing else may run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def checkout(rev: str, where: Path) -> Path:
    """A detached worktree of ``rev`` (removed by the caller)."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(where), rev], check=True)
    return where


def bench_args(model: str, quick: bool) -> dict[str, list[str]]:
    if quick:
        small = ["--model", model]
        return {
            "engine": small
            + "--contexts 256 --policy-context 256 --overhead-context 128 --memory-contexts 256 "
            "--budget 64 --stride 128 --new-tokens 6 --repeats 1 --overhead-repeats 1 --memory-repeats 1".split(),
            "prefill": small
            + "--prefill --prefill-contexts 256 512 --strides 0 --prefill-repeats 1 "
            "--prefill-policies full h2o tova snapkv roco".split(),
            "batch": small + "--context 128 --new-tokens 6 --rounds 1 --parts throughput steps".split(),
        }
    return {
        "engine": ["--model", model]
        + "--contexts 4096 --policy-context 4096 --overhead-context 1024 --memory-contexts 4096 --new-tokens 33 "
        "--repeats 1 --overhead-repeats 3 --memory-repeats 1".split(),
        "prefill": ["--model", model]
        + "--prefill --prefill-contexts 4096 8192 --strides 0 --prefill-repeats 1 "
        "--prefill-policies full h2o tova snapkv roco adakv".split(),
        "batch": ["--model", model] + "--new-tokens 32 --rounds 1 --parts throughput steps".split(),
    }


def run_part(tree: Path, part: str, args: list[str], out: Path) -> None:
    script = "bench_batch.py" if part == "batch" else "bench_engine.py"
    out.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "scripts" / script), *args, "--out", str(out)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=tree, env=env, stdout=subprocess.DEVNULL)


def figures(out: Path, model: str) -> dict[str, float]:
    """The compared ratios of one revision's round (lower is better for every one but ``decode vs generate``)."""
    engine = json.loads((out / "engine" / "bench_engine.json").read_text())
    prefill = json.loads((out / "prefill" / f"bench_prefill_{model}.json").read_text())
    batch = json.loads((out / "batch" / f"bench_batch_{model}.json").read_text())
    got = {"B=1 decode tokens/s vs generate": engine["overhead"]["decode_tokens_per_s_ratio"]}
    got |= {f"B=1 step {k} / {'window'}": v for k, v in engine["policy_vs_window"].items() if k != "window"}
    for n, row in prefill["one chunk"].items():
        got |= {f"prefill {k} / full @ {n}": v["x_full"] for k, v in row.items() if k != "full"}
        got[f"prefill full s @ {n}"] = row["full"]["s"]
    tput = batch["throughput_tokens_per_s"]
    got["B=8 decode tokens/s vs generate"] = tput["kvbench full B=8"] / tput["generate B=8"]
    steps = batch["step_ms"]
    got |= {f"B=8 step {k} / window": v / steps["window"] for k, v in steps.items() if k != "window"}
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="the revision to compare against")
    ap.add_argument("--head", help="the other revision (default: the working tree)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="tiny settings, to try the script")
    ap.add_argument("--out", type=Path, default=Path("results/bench_versions"))
    args = ap.parse_args()
    args.out = args.out.resolve()
    tmp = Path(tempfile.mkdtemp(prefix="kvbench-versions-"))
    trees = {"base": checkout(args.base, tmp / "base")}
    trees["head"] = checkout(args.head, tmp / "head") if args.head else ROOT
    parts = bench_args(args.model, args.quick)
    try:
        results: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
        for r in range(args.rounds):
            order = ["base", "head"] if r % 2 == 0 else ["head", "base"]
            for part, part_args in parts.items():  # each part alternates between the revisions
                for name in order:
                    run_part(trees[name], part, part_args, args.out / f"{name}-r{r}" / part)
            for name in order:
                results[name].append(figures(args.out / f"{name}-r{r}", args.model))
    finally:
        for tree in trees.values():
            if tree != ROOT:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    table: dict[str, Any] = {}
    for key in results["base"][0]:
        base = statistics.median(r[key] for r in results["base"])
        head = statistics.median(r[key] for r in results["head"] if key in r)
        table[key] = {"base": base, "head": head, "head/base": head / base}
    summary = {"base": args.base, "head": args.head, "figures": table}
    (args.out / "compare.json").write_text(json.dumps(summary, indent=2))
    print(f"| figure | {args.base} | {args.head or 'working tree'} | head / base |\n| --- | --- | --- | --- |")
    for key, row in table.items():
        print(f"| {key} | {row['base']:.3f} | {row['head']:.3f} | {row['head/base']:.3f} |")


if __name__ == "__main__":
    main()
