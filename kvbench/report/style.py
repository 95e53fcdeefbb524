"""Paper style: one colour and marker per policy in every figure, sizes for a two-column paper.

A reader compares figures side by side, so a policy must look the same everywhere; names the
table does not know, and variants of a known policy (``h2o (window=0.75)``, see ``labels``), get a
colour derived from a hash of the label, which is stable across runs; a policy named after its score shows the
label that score declares (``label`` on the class, kvbench.registry).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvbench.metrics.registry import metric_info
from kvbench.policies.parts import SCORES
from kvbench.report.labels import base_name
from kvbench.stages import Stage

BASELINE = "full"
EMPHASISED = "roco"

SINGLE_COLUMN_IN = 3.3
WIDE_IN = 6.9

# Fonts of at least 7 pt once the figure is placed at its natural size in the paper.
PAPER_RC: Any = {  # matplotlib rc names (its stubs type the keys as a Literal union)
    "font.size": 8,
    "axes.titlesize": 8,
    "axes.labelsize": 8,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "legend.fontsize": 7,
    "figure.titlesize": 8,
    "lines.linewidth": 1.2,
    "lines.markersize": 3.5,
    "axes.grid": True,
    "grid.linewidth": 0.4,
    "grid.alpha": 0.4,
    "pdf.fonttype": 42,  # TrueType in the PDF: editable text, accepted by publishers
    "ps.fonttype": 42,
}

STAGE_ORDER = tuple(s.value for s in Stage)


@dataclass(frozen=True)
class PolicyStyle:
    """How one policy is drawn."""

    color: str
    marker: str
    label: str
    linewidth: float = 1.2
    zorder: float = 2.0


_KNOWN: dict[str, PolicyStyle] = {
    "full": PolicyStyle("#000000", "*", "Full cache"),
    "window": PolicyStyle("#7f7f7f", "s", "Window"),
    "streamingllm": PolicyStyle("#8c564b", "v", "StreamingLLM"),
    "random": PolicyStyle("#bcbd22", "x", "Random"),
    "h2o": PolicyStyle("#1f77b4", "o", "H2O"),
    "scissorhands": PolicyStyle("#17becf", "^", "Scissorhands"),
    "tova": PolicyStyle("#9467bd", "D", "TOVA"),
    "roco": PolicyStyle("#d62728", "o", "RoCo", linewidth=2.4, zorder=10.0),
    "snapkv": PolicyStyle("#2ca02c", "P", "SnapKV"),
    "knorm": PolicyStyle("#e377c2", "<", "K-norm"),
    "vatp": PolicyStyle("#ff7f0e", ">", "VATP"),
    "pyramidkv": PolicyStyle("#006d2c", "h", "PyramidKV"),
    "adakv": PolicyStyle("#6baed6", "p", "Ada-KV"),
    "mean_window": PolicyStyle("#525252", "d", "Mean window"),
    "accumulated_robust": PolicyStyle("#fd8d3c", "X", "Accumulated (robust)"),
}

# Colours and markers not used above, for policies the table does not name.
_FALLBACK_COLORS = ("#393b79", "#8c6d31", "#843c39", "#7b4173", "#636363", "#b5cf6b", "#9c9ede")
_FALLBACK_MARKERS = ("8", "H", "+", "1", "|")


def policy_style(name: str) -> PolicyStyle:
    """The style of ``name``; unknown names get a deterministic colour/marker from a CRC of the name, and a
    variant of a known policy its marker and display name with a colour from a CRC of the whole label."""
    base = base_name(name)
    known = _KNOWN.get(base.lower())
    if known is not None and base == name:
        return known
    digest = zlib.crc32(name.encode())
    color = _FALLBACK_COLORS[digest % len(_FALLBACK_COLORS)]
    if known is not None:
        return PolicyStyle(color, known.marker, known.label + name[len(base) :], known.linewidth, known.zorder)
    shown = (SCORES.label(base) if base in SCORES else base) + name[len(base) :]
    return PolicyStyle(color, _FALLBACK_MARKERS[(digest // len(_FALLBACK_COLORS)) % len(_FALLBACK_MARKERS)], shown)


def is_baseline(name: str) -> bool:
    """The full cache, whatever settings its label names (a quantised full cache is a reference too)."""
    return base_name(name) == BASELINE


def sort_policies(names: Iterable[str]) -> list[str]:
    """Known policies in table order (baseline first, each followed by its variants), then the others
    alphabetically."""
    order = {name: i for i, name in enumerate(_KNOWN)}
    return sorted(set(names), key=lambda n: (order.get(base_name(n).lower(), len(order)), n))


def sort_stages(names: Iterable[str]) -> list[str]:
    """prefill, decode, both, then anything else alphabetically."""
    return sorted(set(names), key=lambda s: (STAGE_ORDER.index(s) if s in STAGE_ORDER else len(STAGE_ORDER), s))


def lower_is_better(metric: str) -> bool:
    """As the metric declares (kvbench.metrics.registry); an undeclared name is taken as higher-is-better."""
    return not metric_info(metric).higher_is_better


def metric_label(metric: str) -> str:
    """The metric's display name (its own name when undeclared)."""
    return metric_info(metric).label


def direction(metric: str) -> str:
    """ "higher is better" or "lower is better", saying so when the direction is assumed (an undeclared name)."""
    info = metric_info(metric)
    text = "higher is better" if info.higher_is_better else "lower is better"
    return text if info.declared else f"{text}: assumed, {metric!r} is not a declared metric"
