"""Benchmark the engine itself: overhead against transformers' ``generate``, how decode cost grows with
context under a fixed budget, what each policy's statistics cost, prefill peak memory, and every
decode speed as a fraction of the memory-bandwidth floor (weight bytes per token / read bandwidth).

    python scripts/bench_engine.py                      # SmolLM2, docs/perf/engine.md
    python scripts/bench_engine.py --model tiny-llama --contexts 256 512 --policy-context 512 --overhead-context 256 \
        --memory-contexts 256 --budget 64 --stride 128 --new-tokens 8 --repeats 1 --out /tmp/bench   # seconds
    python scripts/bench_engine.py --prefill                      # SmolLM2, docs/perf/prefill.md's tables
    python scripts/bench_engine.py --prefill --model gemma3-270m --prefill-contexts 8192 16384 32768 --strides 0

After a warm-up: the overhead comparison takes the median of ``--overhead-repeats`` whole runs of each,
transformers' and kvbench's alternating. Every other decode figure compares runs step by step: each of the
compared runs encodes its prompt, then they decode one token each in turn (the order rotating every step),
so that a slow spell of a shared machine lands on all of them alike (the growth table interleaves every
policy at every context in one set); a figure is the median of a run's ``--new-tokens`` steps over
``--repeats`` such rounds. CPU here, CUDA when present.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
from omegaconf import OmegaConf

from kvbench.engine import measure
from kvbench.engine.attention import kvbench_attention_enabled
from kvbench.engine.engine import DecodeSettings, Engine, EngineSettings, Request
from kvbench.models import LoadedModel, load_model
from kvbench.policies.registry import build_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill_bench import POLICIES as PREFILL_POLICIES  # noqa: E402
from prefill_bench import prefill_markdown, prefill_table

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MODELS = {
    "smollm2-135m": {"source": "embedded", "embedded": "smollm2"},
    "gemma3-270m": {"source": "embedded", "embedded": "gemma3-270m"},
    "tiny-llama": {"source": "tiny"},
}
STATISTICS_POLICIES = ["h2o", "scissorhands", "tova", "roco", "snapkv", "vatp", "mean_window", "accumulated_robust"]


def policy(name: str) -> Any:
    return build_policy(OmegaConf.to_container(OmegaConf.load(CONFIGS / "policy" / f"{name}.yaml"), resolve=True))


def available(names: list[str]) -> list[str]:
    return [n for n in names if (CONFIGS / "policy" / f"{n}.yaml").exists()]


def median_of(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def read_bandwidth(device: torch.device, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s a full read of a large buffer achieves (a reduction touches every byte once)."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32, device=device)
    x.sum()

    def once() -> float:
        t = measure.now(device)
        x.sum()
        return measure.now(device) - t

    seconds = median_of(once, repeats)
    return x.numel() * 4 / seconds


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters read per decoded token (tied matrices counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def prompt_ids(lm: LoadedModel, n: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(100, min(lm.model.config.vocab_size, 20000), (n,), generator=g).tolist()


def hf_generate_times(lm: LoadedModel, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds per token) of transformers' generate, greedy, same tokens."""
    x = torch.tensor([ids], device=lm.device)

    def run(n: int) -> float:
        t = measure.now(lm.device)
        lm.model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return measure.now(lm.device) - t

    prefill = run(1)
    total = run(new_tokens)
    return prefill, (total - prefill) / (new_tokens - 1)


def kvbench_times(
    lm: LoadedModel,
    ids: list[int],
    name: str,
    budget: float | int,
    stage: str,
    new_tokens: int,
    stride: int | None = None,
) -> tuple[float, float]:
    """(prefill seconds, median decode seconds per token) of one kvbench generation."""
    lm.model.generation_config.eos_token_id = None  # with no tokenizer either: exactly new_tokens
    engine = Engine(lm.model, None, EngineSettings(policy(name), budget, stage, stride=stride))
    (g,) = engine.run([Request(ids, settings=DecodeSettings(max_new_tokens=new_tokens))])
    return g.measures.timings.prefill_s, statistics.median(g.decode_latencies_s)


def interleaved_step_ms(
    lm: LoadedModel,
    runs: dict[Any, tuple[Any, float | int, str, list[int]]],
    args: argparse.Namespace,
    reduce: Callable[[list[float]], float] = statistics.median,
) -> dict[Any, float]:
    """Per label (label -> (policy's config name or built policy, budget, stage, prompt ids)), the median decode
    step in ms (``reduce``: another statistic of the steps). In each of
    ``--repeats`` rounds every run encodes its prompt, then the runs decode one token each in turn, the order
    rotating every step: what a disturbance of the machine costs, it costs every run alike."""
    lm.model.generation_config.eos_token_id = None  # with no tokenizer either: exactly new_tokens every run
    steps: dict[Any, list[float]] = {label: [] for label in runs}
    settings = DecodeSettings(max_new_tokens=args.new_tokens)
    with kvbench_attention_enabled(lm.model):  # held across the interleaved generations
        for _ in range(args.repeats):
            live = {}
            for label, (name, budget, stage, ids) in runs.items():
                built = policy(name) if isinstance(name, str) else name  # a config's name, or a built policy
                engine = Engine(lm.model, None, EngineSettings(built, budget, stage, stride=args.stride))
                live[label] = engine.steps([Request(ids, settings=settings)])
                next(live[label])  # the prompt
            for step in itertools.count():
                if not live:
                    break
                labels = list(live)
                for label in labels[step % len(labels) :] + labels[: step % len(labels)]:
                    for _, g in next(live[label]):
                        steps[label] += g.decode_latencies_s
                        del live[label]
    return {label: reduce(xs) * 1e3 for label, xs in steps.items()}


def baseline(label: str) -> str:
    """The run a policy's decode step is compared with: window in the same stage."""
    return "window (prefill)" if label.endswith("(prefill)") else "window"


def peak_rss_during(fn: Callable[[], Any]) -> int:
    """Peak resident bytes above the level before ``fn``, sampled every millisecond (CPU)."""
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    fn()
    done.set()
    thread.join()
    return peak[0] - base


def prefill_peak(lm: LoadedModel, ids: list[int], name: str, stride: int | None) -> int:
    """Peak memory of one prefill (budget 512) above what was allocated before it."""

    def run() -> None:
        engine = Engine(lm.model, lm.tokenizer, EngineSettings(policy(name), 512, stride=stride))
        engine.run([Request(ids, settings=DecodeSettings(max_new_tokens=1))])

    if lm.device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(lm.device)
        torch.cuda.reset_peak_memory_stats(lm.device)
        run()
        return torch.cuda.max_memory_allocated(lm.device) - base
    run()  # a first pass sizes the fused weights and allocator pools; the second is measured
    return peak_rss_during(run)


def _fresh_process_peak(model: str, n: int, name: str, stride: int | None) -> int:
    lm = load_model(model, **MODELS[model])
    return prefill_peak(lm, prompt_ids(lm, n), name, stride)


def prefill_peak_isolated(model: str, n: int, name: str, stride: int | None) -> int:
    """Each measurement in a fresh process: memory a previous run freed but kept would hide the peak."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_fresh_process_peak, model, n, name, stride).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=65)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--overhead-context", type=int, default=1024)
    ap.add_argument("--overhead-repeats", type=int, default=5)
    ap.add_argument("--policy-context", type=int, default=4096)
    ap.add_argument("--memory-contexts", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--memory-repeats", type=int, default=2)
    ap.add_argument("--stride", type=int, default=1024, help="prefill chunk for the fixed-budget runs")
    ap.add_argument("--out", default="results/bench_engine")
    ap.add_argument(
        "--render",
        metavar="JSON",
        help="only print the tables of a saved bench_engine.json or bench_prefill_<model>.json",
    )
    ap.add_argument("--prefill", action="store_true", help="only the prefill table (prefill_bench.py)")
    ap.add_argument("--prefill-contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--strides", type=int, nargs="+", default=[0, 1024], help="prefill chunks; 0: one chunk")
    ap.add_argument("--prefill-repeats", type=int, default=2)
    ap.add_argument("--prefill-policies", nargs="+", default=PREFILL_POLICIES)
    args = ap.parse_args()
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        print(prefill_markdown(saved, args.model) if "budget" in saved else markdown(saved))
        return

    lm = load_model(args.model, **MODELS[args.model])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.prefill:
        table = prefill_table(
            lm,
            policy,
            lambda n: prompt_ids(lm, n),
            args.prefill_contexts,
            args.strides,
            args.prefill_repeats,
            available(args.prefill_policies),
        )
        table |= {"device": str(lm.device), "dtype": str(lm.dtype), "threads": torch.get_num_threads()}
        (out / f"bench_prefill_{args.model}.json").write_text(json.dumps(table, indent=2))
        print(prefill_markdown(table, f"{args.model} on {lm.device} ({lm.dtype}, {torch.get_num_threads()} threads)"))
        return
    report: dict[str, Any] = {"device": str(lm.device), "dtype": str(lm.dtype), "threads": torch.get_num_threads()}

    bandwidth = read_bandwidth(lm.device)
    floor_s = weight_bytes(lm.model) / bandwidth
    report.update(bandwidth_gb_s=bandwidth / 1e9, weight_mb=weight_bytes(lm.model) / 1e6, floor_ms=floor_s * 1e3)
    print(
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s, weights {weight_bytes(lm.model) / 1e6:.0f} MB, "
        f"floor {floor_s * 1e3:.2f} ms/token"
    )

    ids = prompt_ids(lm, args.overhead_context)
    kvbench_times(lm, ids[:64], "full", 1.0, "prefill", 4)  # warm-up
    hf_generate_times(lm, ids[:64], 4)
    hf, kv = [], []
    for _ in range(args.overhead_repeats):  # alternating, so that a slow spell does not favour either
        hf.append(hf_generate_times(lm, ids, args.new_tokens))
        kv.append(kvbench_times(lm, ids, "full", 1.0, "prefill", args.new_tokens))
    hf_prefill, hf_step = statistics.median(p for p, _ in hf), statistics.median(s for _, s in hf)
    kv_prefill, kv_step = statistics.median(p for p, _ in kv), statistics.median(s for _, s in kv)
    report["overhead"] = {
        "context": args.overhead_context,
        "hf_prefill_s": hf_prefill,
        "kvbench_prefill_s": kv_prefill,
        "hf_decode_ms": hf_step * 1e3,
        "kvbench_decode_ms": kv_step * 1e3,
        "prefill_ratio": hf_prefill / kv_prefill,
        "decode_tokens_per_s_ratio": hf_step / kv_step,
        "hf_floor_fraction": floor_s / hf_step,
        "kvbench_floor_fraction": floor_s / kv_step,
    }
    print("overhead:", json.dumps(report["overhead"], indent=1))

    # Every policy at every context in one interleaved set: a slow spell cannot pass for growth with context.
    growth_names = ["full"] + available(["window", "h2o", "roco"])
    growth: dict[str, dict[int, float]] = {name: {} for name in growth_names}
    runs = {
        (name, n): (name, 1.0, "prefill", prompt_ids(lm, n))
        if name == "full"
        else (name, args.budget, "both", prompt_ids(lm, n))
        for name in growth_names
        for n in args.contexts
    }
    for (name, n), ms in interleaved_step_ms(lm, runs, args).items():
        growth[name][n] = ms
        print(f"decode {name:>12} @ {n:>5}: {ms:.2f} ms/token")
    report["growth_ms"] = growth

    ctx = prompt_ids(lm, args.policy_context)
    names = ["window"] + available(STATISTICS_POLICIES + ["streamingllm", "random", "knorm", "pyramidkv", "adakv"])
    runs = {"full": ("full", 1.0, "prefill", ctx)} | {
        name: (name, args.budget * 2, "both", ctx) for name in dict.fromkeys(names)
    }
    # Policies that only compress the prompt as published (SnapKV's observation window and its family):
    # also their decode steps in that use, holding the compressed prompt plus the new tokens, against
    # window in the same use.
    runs |= {
        f"{name} (prefill)": (name, args.budget * 2, "prefill", ctx)
        for name in ["window"] + available(["snapkv", "pyramidkv", "adakv"])
    }
    per_policy = interleaved_step_ms(lm, runs, args)
    report["policy_ms"] = per_policy
    report["policy_vs_window"] = {k: v / per_policy[baseline(k)] for k, v in per_policy.items()}
    for k, v in per_policy.items():
        print(f"policy {k:>18}: {v:.2f} ms/token = {report['policy_vs_window'][k]:.2f} x {baseline(k)}")

    memory: dict[str, dict[int, int]] = {}
    for name in ["full"] + available(["h2o", "roco", "snapkv"]):
        # RSS also holds what the allocator kept from freed blocks, which varies from process to process;
        # the least of ``--memory-repeats`` fresh processes is the closest to what the prefill needed.
        memory[name] = {
            n: min(prefill_peak_isolated(args.model, n, name, None) for _ in range(args.memory_repeats))
            for n in args.memory_contexts
        }
        print(f"prefill peak {name:>8}:", {n: f"{b / 1e6:.0f} MB" for n, b in memory[name].items()})
    report["prefill_peak_bytes"] = memory

    (out / "bench_engine.json").write_text(json.dumps(report, indent=2))
    plot_growth(growth, out / "decode_cost_growth.png", floor_s * 1e3)
    print(markdown(report))


def plot_growth(growth: dict[str, dict[int, float]], path: Path, floor_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3.3, 2.4))
    for name, points in growth.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=name, linestyle="--" if name == "full" else "-")
    ax.axhline(floor_ms, color="grey", linewidth=0.8, linestyle=":", label="bandwidth floor")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode ms / token")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=200)


def markdown(r: dict[str, Any]) -> str:
    o = r["overhead"]
    r["growth_ms"] = {name: {int(n): ms for n, ms in pts.items()} for name, pts in r["growth_ms"].items()}
    lines = [
        f"Device {r['device']} ({r['threads']} threads), {r['dtype']}; read bandwidth {r['bandwidth_gb_s']:.1f} GB/s, "
        f"weights {r['weight_mb']:.0f} MB, floor {r['floor_ms']:.2f} ms/token.",
        "",
        "| measure | transformers generate | kvbench full | ratio |",
        "| --- | --- | --- | --- |",
        f"| prefill s @ {o['context']} | {o['hf_prefill_s']:.3f} | {o['kvbench_prefill_s']:.3f} "
        f"| {o['prefill_ratio']:.2f} |",
        f"| decode ms/token | {o['hf_decode_ms']:.2f} | {o['kvbench_decode_ms']:.2f} "
        f"| {o['decode_tokens_per_s_ratio']:.2f} |",
        f"| fraction of bandwidth floor | {o['hf_floor_fraction']:.2f} | {o['kvbench_floor_fraction']:.2f} | |",
        "",
        "| decode ms/token | " + " | ".join(str(c) for c in next(iter(r["growth_ms"].values()))) + " | growth |",
        "| --- |" + " --- |" * (len(next(iter(r["growth_ms"].values()))) + 1),
    ]
    for name, pts in r["growth_ms"].items():
        xs = sorted(pts)
        lines.append(
            f"| {name} | " + " | ".join(f"{pts[x]:.2f}" for x in xs) + f" | {pts[xs[-1]] / pts[xs[0]] - 1:+.0%} |"
        )
    lines += ["", "| policy @ context | ms/token | × window | fraction of floor |", "| --- | --- | --- | --- |"]
    for name, ms in r["policy_ms"].items():
        lines.append(f"| {name} | {ms:.2f} | {r['policy_vs_window'][name]:.2f} | {r['floor_ms'] / ms:.2f} |")
    lines += [
        "",
        "| prefill peak above baseline | "
        + " | ".join(str(c) for c in next(iter(r["prefill_peak_bytes"].values())))
        + " |",
        "| --- |" + " --- |" * len(next(iter(r["prefill_peak_bytes"].values()))),
    ]
    for name, pts in r["prefill_peak_bytes"].items():
        lines.append(f"| {name} | " + " | ".join(f"{b / 1e6:.0f} MB" for b in pts.values()) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
