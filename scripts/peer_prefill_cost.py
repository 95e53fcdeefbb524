#!/usr/bin/env python
"""kvpress's own prefill cost of a press against its plain prefill, on this machine (docs/perf/methods_ii.md).

Runs in the kvpress peer environment (docs/peers.md), on SmolLM2 as scripts/peer_kvpress_side.py loads it:

    PEER/bin/python scripts/peer_prefill_cost.py --presses KVzipPress KVgradPress --contexts 4096 8192

Each prompt (random ids, the same for every run) is prefilled with no press and with each press at
``compression_ratio`` 0.75, interleaved in this one process; the median seconds of each and its ratio to the plain
prefill are printed, so that kvbench's ratios (scripts/bench_methods.py) can be read beside kvpress's own.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import kvpress
import torch
from kvpress.presses import kvzip_press
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_kvpress_side import GGUFTokenizer, load_model  # noqa: E402


def prefill_seconds(model: object, ids: list[int], press: object | None) -> float:
    start = time.perf_counter()
    with torch.inference_mode(), press(model) if press is not None else nullcontext():  # type: ignore[operator]
        model.model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache())  # type: ignore[attr-defined]
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presses", nargs="+", default=["KVzipPress", "KVgradPress"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[4096, 8192])
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_model()
    kvzip_press.AutoTokenizer = GGUFTokenizer  # type: ignore[misc]
    names = ["none", *args.presses]
    build = {name: (lambda n=name: getattr(kvpress, n)(compression_ratio=0.75)) for name in args.presses}
    prefill_seconds(model, list(range(100, 356)), None)  # warm up
    for n in args.contexts:
        ids = torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        runs: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(args.repeats):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                runs[name].append(prefill_seconds(model, ids, build[name]() if name != "none" else None))
                print(f"{n} tokens: {name:>12} {runs[name][-1]:7.2f} s", flush=True)
        plain = statistics.median(runs["none"])
        for name in names:
            s = statistics.median(runs[name])
            print(f"| {n} | {name} | {s:.1f} | {s / plain:.2f} |")


if __name__ == "__main__":
    main()
