"""The figures and ``profile.md`` of one profile (``kvbench-profile``'s ``profile.json``): layer × head heatmaps
of entropy, sink mass and concentration; attention recall against budget (one line per score, the oracle dashed);
the std of received attention against a token's age."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from kvbench.report.plots import save_figure
from kvbench.report.style import WIDE_IN

HEATMAPS = (
    ("entropy", "Entropy (nats)"),
    ("sink_mass", "Sink mass"),
    ("recent_mass", "Recent mass"),
    ("coverage_90", "Keys for 90 % of mass"),
)
ORACLE = "oracle"
MIN_AGE_SHARE = 0.1


def heatmap_figure(data: dict[str, Any]) -> Figure:
    fig = Figure(figsize=(WIDE_IN, 2.6), layout="constrained")
    axes = fig.subplots(1, len(HEATMAPS))
    for ax, (name, title) in zip(axes, HEATMAPS):
        grid = np.array(data["heads"][name])  # [layers, heads]
        image = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
        ax.set_title(title)
        ax.set_xlabel("KV head")
        ax.grid(False)
        fig.colorbar(image, ax=ax, shrink=0.8)
    axes[0].set_ylabel("Layer")
    fig.suptitle(f"{data['model']} on {data['task']} ({data['examples']} prompts)")
    return fig


def recall_figure(data: dict[str, Any]) -> Figure:
    """Recall (mean over the budget's layers) against budget: scores alone, then full policies; oracle dashed."""
    fig = Figure(figsize=(WIDE_IN, 2.6), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    x = [100 * b if isinstance(b, float) else b for b in data["budgets"]]
    for ax, kind in zip(axes, ("score", "policy")):
        names = [n for n, k in data["kinds"].items() if k == kind]
        for name in names:
            ax.plot(x, data["recall_mean"][name], marker="o", label=name.partition("/")[2], gid=name)
        ax.plot(x, data["recall_mean"][ORACLE], "k--", label="oracle top-B", gid=ORACLE)
        ax.set_title("Scores (scope all)" if kind == "score" else "Policies (score + scope + allocation)")
        ax.set_xlabel("Budget (% of the prompt)" if isinstance(data["budgets"][0], float) else "Budget (tokens)")
        ax.legend(fontsize=6, ncol=2)
    axes[0].set_ylabel("Attention recall")
    return fig


def age_figure(data: dict[str, Any]) -> Figure:
    """Std of the attention a token receives against its age, one line per layer (darker = deeper)."""
    fig = Figure(figsize=(WIDE_IN / 2, 2.6), layout="constrained")
    ax = fig.subplots()
    stds, counts = data["age"]["std"], data["age"]["count"]
    colors = _depth_colors(len(stds))
    for layer, (row, count) in enumerate(zip(stds, counts)):
        # ages at least a tenth as common as age 1: the oldest ages are seen by few queries, mostly on the sinks
        enough = MIN_AGE_SHARE * count[1] if len(count) > 1 else 0
        ages = [a for a, v in enumerate(row) if v is not None and v > 0 and a > 0 and count[a] >= enough]
        ax.plot(ages, [row[a] for a in ages], color=colors[layer], linewidth=0.8, gid=f"layer{layer}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("Token age (queries since it was written)")
    ax.set_ylabel("Std of received attention")
    ax.set_title("Std by age (lighter: lower layers)")
    return fig


def _depth_colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    return [colormaps["viridis"](0.9 - 0.8 * i / max(1, n - 1)) for i in range(n)]


def profile_markdown(data: dict[str, Any]) -> str:
    budgets = data["budgets"]
    layers = data["layers"]
    chosen = data["budget_layers"]
    lines = [
        f"# Attention profile: {data['model']} on {data['task']}",
        "",
        f"{data['examples']} prompts of {min(data['prompt_tokens'])} to {max(data['prompt_tokens'])} tokens, "
        f"continuations of {min(data['continuation_tokens'])} to {max(data['continuation_tokens'])} tokens. "
        f"Sink mass: attention on the first {data['n_sink']} tokens; recent mass: on the {data['n_recent']} "
        "newest a query sees; coverage: the fraction of the keys a query sees that it needs for 90 % / 95 % of its "
        "mass. Means over the prompt's queries and KV heads (query heads reduced to KV heads by their mean).",
        "",
        "![heatmaps](heatmaps.png)",
        "",
        "| layer | window | entropy | sink mass | recent mass | coverage 90 % | coverage 95 % "
        "| continuation on prompt |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, window in enumerate(data["windows"]):
        lines.append(
            f"| {i} | {window or 'full'} | {layers['entropy'][i]:.2f} | {layers['sink_mass'][i]:.3f} | "
            f"{layers['recent_mass'][i]:.3f} | {layers['coverage_90'][i]:.3f} | {layers['coverage_95'][i]:.3f} | "
            f"{layers['future_prompt_share'][i]:.3f} |"
        )
    lines += [
        "",
        "## Consistency: attention recall of the kept set",
        "",
        "The share of the continuation's attention on the prompt that falls on the set each candidate keeps at "
        f"the end of the prompt, mean over layers {_ranges(chosen)} (those the budget applies to) and KV heads; "
        "the oracle keeps each head's top-B of that future mass.",
        "",
        "![recall](recall.png)",
        "",
        "| candidate | kind | " + " | ".join(f"B = {b}" for b in budgets) + " |",
        "|---|---|" + "---|" * len(budgets),
    ]
    order = sorted(data["recall_mean"], key=lambda n: (data["kinds"][n] != ORACLE, -np.mean(data["recall_mean"][n])))
    for name in order:
        values = " | ".join(f"{v:.3f}" for v in data["recall_mean"][name])
        lines.append(f"| {name} | {data['kinds'][name]} | {values} |")
    best = most_consistent(data, "score")
    lines += [
        "",
        "Most consistent score at each budget: "
        + ", ".join(f"B = {b}: {name} ({value:.3f})" for b, (name, value) in zip(budgets, best))
        + ".",
        "",
        "## Robustness: std of received attention by age",
        "",
        "![age](age_std.png)",
        "",
        f"Ages seen by at least {MIN_AGE_SHARE:.0%} as many (query, token) pairs as age 1 (the oldest ages are "
        "reached by few queries, mostly on the first tokens); pooled over KV heads and prompts.",
        "",
    ]
    return "\n".join(lines)


def most_consistent(data: dict[str, Any], kind: str) -> list[tuple[str, float]]:
    """Per budget, the candidate of ``kind`` with the highest mean recall."""
    names = [n for n, k in data["kinds"].items() if k == kind]
    out = []
    for i in range(len(data["budgets"])):
        name = max(names, key=lambda n: data["recall_mean"][n][i])
        out.append((name, data["recall_mean"][name][i]))
    return out


def _ranges(layers: list[int]) -> str:
    return f"{layers[0]}–{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else str(layers)


def build_profile_report(out_dir: Path) -> list[Path]:
    """Figures (PNG + PDF) and ``profile.md`` beside ``profile.json``."""
    data = json.loads((out_dir / "profile.json").read_text())
    paths = []
    for stem, make in (("heatmaps", heatmap_figure), ("recall", recall_figure), ("age_std", age_figure)):
        paths += save_figure(make(data), out_dir, stem)
    (out_dir / "profile.md").write_text(profile_markdown(data))
    return paths + [out_dir / "profile.md"]
