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
from kvbench.report.labels import DISPLAY_NAMES, base_name
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
    linestyle: Any = "-"


DASH_DOT: Any = (0, (4, 1.2, 1, 1.2))
DOTTED: Any = (0, (1, 1))
# Each named policy: a colour, a marker and a line style of its own (no two alike), so that a figure of thirty
# lines still tells them apart; the display name comes from labels.DISPLAY_NAMES.
_KNOWN: dict[str, tuple[str, str, Any]] = {
    "full": ("#000000", "*", "--"),
    "window": ("#7f7f7f", "s", "-"),
    "streamingllm": ("#8c564b", "v", "-"),
    "random": ("#bcbd22", "x", "-"),
    "h2o": ("#1f77b4", "o", "-"),
    "scissorhands": ("#17becf", "^", "-"),
    "tova": ("#9467bd", "D", "-"),
    "roco": ("#d62728", "o", "-"),
    "snapkv": ("#2ca02c", "P", "-"),
    "knorm": ("#e377c2", "<", "-"),
    "vatp": ("#ff7f0e", ">", "-"),
    "pyramidkv": ("#006d2c", "h", "-"),
    "adakv": ("#6baed6", "p", "-"),
    "mean_window": ("#525252", "d", "-"),
    "accumulated_robust": ("#fd8d3c", "X", "-"),
    "keydiff": ("#393b79", "o", DASH_DOT),
    "cur": ("#8c6d31", "s", DASH_DOT),
    "lagkv": ("#843c39", "^", DASH_DOT),
    "leverage": ("#7b4173", "D", DASH_DOT),
    "threshold": ("#637939", "v", DASH_DOT),
    "cam": ("#e7969c", "P", DASH_DOT),
    "rkv": ("#5254a3", "X", DASH_DOT),
    "expected_attention": ("#d6616b", "h", DOTTED),
    "criticalkv": ("#ad494a", "p", DOTTED),
    "criticalkv_adakv": ("#6b6ecf", "<", DOTTED),
    "chunkkv": ("#8ca252", ">", DOTTED),
    "noncausal_attn": ("#ce6dbd", "d", DOTTED),
    "compactor": ("#31a354", "8", DOTTED),
    "cap": ("#bd9e39", "H", DOTTED),
}
_EMPHASIS = {EMPHASISED: (2.4, 10.0)}  # (line width, z-order): the method a paper argues for stands out

# For policies the table does not name and variants of named ones: tab20's colours (a qualitative palette large
# enough for a sweep's variants) by three line styles and the markers below.
_FALLBACK_COLORS = (
    "#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896", "#9467bd", "#c5b0d5",
    "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7", "#bcbd22", "#dbdb8d", "#17becf", "#9edae5",
)  # fmt: skip
_FALLBACK_LINESTYLES: tuple[Any, ...] = ("-", DASH_DOT, DOTTED)
_FALLBACK_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h", "8", "H")


def display_name(name: str) -> str:
    """A policy's one display name: the paper's (labels.DISPLAY_NAMES), else its score's declared label, else the
    config name; a variant keeps what sets it apart (``H2O (window=0.75)``)."""
    base = base_name(name)
    shown = DISPLAY_NAMES.get(base.lower()) or (SCORES.label(base) if base in SCORES else base)
    return shown + name[len(base) :]


def resolve_policy(option: str, given: str, policies: Iterable[str]) -> str:
    """The policy label of ``policies`` that ``given`` names, by its config name or its display name in any case
    (``snapkv``, ``SnapKV``); else one error naming ``option`` and every valid name."""
    labels = sorted(set(policies))
    if given in labels:
        return given
    wanted = given.casefold()
    found = [label for label in labels if wanted in (label.casefold(), display_name(label).casefold())]
    if len(found) == 1:
        return found[0]
    valid = ", ".join(f"{label} ({display_name(label)})" for label in sort_policies(labels))
    raise ValueError(f"{option} {given}: no such policy in the rows; give one of (either name, any case): {valid}")


def _fallback(name: str, index: int, marker: str | None = None) -> PolicyStyle:
    combos = len(_FALLBACK_COLORS) * len(_FALLBACK_LINESTYLES)
    index %= combos
    color = _FALLBACK_COLORS[index % len(_FALLBACK_COLORS)]
    linestyle = _FALLBACK_LINESTYLES[index // len(_FALLBACK_COLORS)]
    marker = marker or _FALLBACK_MARKERS[index % len(_FALLBACK_MARKERS)]
    return PolicyStyle(color, marker, display_name(name), linestyle=linestyle)


def policy_style(name: str) -> PolicyStyle:
    """The style of ``name``: a named policy's own; a variant of one its marker with a colour and line style from a
    CRC of the whole label, an unknown name all three from a CRC (stable across runs and figures)."""
    base = base_name(name)
    known = _KNOWN.get(base.lower())
    if known is not None and base == name:
        width, zorder = _EMPHASIS.get(base.lower(), (1.2, 2.0))
        color, marker, linestyle = known
        return PolicyStyle(color, marker, display_name(name), width, zorder, linestyle)
    return _fallback(name, zlib.crc32(name.encode()), known[1] if known else None)


def policy_styles(names: Iterable[str]) -> dict[str, PolicyStyle]:
    """The styles of the policies one figure draws: each its ``policy_style``, except that a hashed style which
    repeats another's colour and line style moves to the next free combination, so no two lines look alike."""
    ordered = sort_policies(names)
    out = {n: policy_style(n) for n in ordered if base_name(n) == n and n.lower() in _KNOWN}
    taken = {(s.color, str(s.linestyle)) for s in out.values()}
    for name in (n for n in ordered if n not in out):
        style, start = policy_style(name), zlib.crc32(name.encode())
        step = 0
        while (style.color, str(style.linestyle)) in taken and step < len(_FALLBACK_COLORS) * 3:
            step += 1
            style = _fallback(name, start + step, style.marker)
        taken.add((style.color, str(style.linestyle)))
        out[name] = style
    return out


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


def budget_axis_label(stage: str, unit: str = "%") -> str:
    """What a requested budget is a share of: the prompt, except in stage=decode, where the cache also holds what
    is generated (kvbench.budget)."""
    reference = "prompt + max_new_tokens" if stage == Stage.decode.value else "the prompt"
    return f"KV budget ({unit} of {reference})"


def memory_text(gib: float) -> str:
    """A memory amount in the unit that reads best: ``64 MiB``, ``1.5 GiB``."""
    return f"{gib * 1024:.4g} MiB" if gib < 1 else f"{gib:.4g} GiB"
