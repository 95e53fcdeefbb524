"""Kept sets of two implementations compared row by row (one row: one KV head of one layer of one prompt), and the
table of docs/peers.md. NumPy only: scripts/peer_agreement.py feeds it, tests/test_peer_compare.py checks it.

A row where the two kept sets differ is explained when it can be:

- ``kept count``: the two kept different numbers of entries (a rounding of the kept count, or a per-layer or
  per-head allocation that differs); such a row is *nested* when the smaller set lies inside the larger, as two
  top-k's of one ranking do;
- ``tie``: same count, and the other's kept set is an equally good top-k of the peer's own scores: every entry
  only the peer kept scores within ``eps`` (relative to the cut's score) of every entry only kvbench kept;
- ``unexplained``: anything else. The row's swapped entries and both sides' scores of them are kept for the page.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

REASONS = ("kept count", "tie", "unexplained")


@dataclass
class RowDiff:
    """One differing row: where it is, why, and the entries only one side kept with both sides' scores of them."""

    prompt: int
    layer: int
    head: int
    reason: str
    peer_only: list[int]
    ours_only: list[int]
    gap: float  # how far apart (relative to the cut) the peer's scores of the swapped entries are; 0 for a tie
    nested: bool = False  # the smaller kept set lies inside the larger
    peer_scores: dict[int, float] = field(default_factory=dict)
    our_scores: dict[int, float] = field(default_factory=dict)


@dataclass
class Agreement:
    """A method's rows over every prompt."""

    rows: int = 0
    identical: int = 0
    jaccard_sum: float = 0.0
    reasons: Counter[str] = field(default_factory=Counter)
    diffs: list[RowDiff] = field(default_factory=list)
    nested: int = 0  # kept-count rows whose smaller set lies inside the larger

    @property
    def identical_share(self) -> float:
        return self.identical / self.rows if self.rows else float("nan")

    @property
    def mean_jaccard(self) -> float:
        return self.jaccard_sum / self.rows if self.rows else float("nan")

    @property
    def explained(self) -> int:
        return sum(n for reason, n in self.reasons.items() if reason != "unexplained")


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """|a ∩ b| / |a ∪ b| of two bool masks (1 for two empty sets)."""
    union = int(np.logical_or(a, b).sum())
    return 1.0 if union == 0 else int(np.logical_and(a, b).sum()) / union


def tie_gap(peer_only: np.ndarray, ours_only: np.ndarray, scores: np.ndarray) -> float:
    """How much higher the peer scored the entries only it kept than those only kvbench kept, relative to the
    largest magnitude among them: <= eps means kvbench's set is also a top-k of the peer's scores. NaN (no score
    recorded) or an infinite score is never a tie."""
    kept, dropped = scores[peer_only], scores[ours_only]
    both = np.concatenate([kept, dropped])
    if not np.all(np.isfinite(both)):
        return float("inf")
    scale = max(float(np.abs(both).max()), np.finfo(np.float32).tiny)
    return max(0.0, float(kept.max() - dropped.min())) / scale


def compare_row(
    ours: np.ndarray, peer: np.ndarray, peer_scores: np.ndarray, our_scores: np.ndarray, eps: float
) -> tuple[str, np.ndarray, np.ndarray, float]:
    """The reason two kept masks [n] differ (``identical`` when they do not), the entries only the peer kept, those
    only kvbench kept, and the tie gap."""
    peer_only, ours_only = np.flatnonzero(peer & ~ours), np.flatnonzero(ours & ~peer)
    if not len(peer_only) and not len(ours_only):
        return "identical", peer_only, ours_only, 0.0
    if int(ours.sum()) != int(peer.sum()):
        return "kept count", peer_only, ours_only, float("nan")
    gap = tie_gap(peer_only, ours_only, peer_scores)
    return ("tie" if gap <= eps else "unexplained"), peer_only, ours_only, gap


def compare(
    agreement: Agreement,
    prompt: int,
    ours: np.ndarray,
    peer: np.ndarray,
    peer_scores: np.ndarray,
    our_scores: np.ndarray,
    eps: float = 1e-5,
) -> Agreement:
    """Adds one prompt's rows: kept masks ``ours`` and ``peer`` [layers, heads, n], both sides' scores alike."""
    if ours.shape != peer.shape:
        raise ValueError(f"kept masks of shapes {ours.shape} and {peer.shape} cannot be compared")
    layers, heads, _ = ours.shape
    for layer in range(layers):
        for head in range(heads):
            a, b = ours[layer, head], peer[layer, head]
            agreement.rows += 1
            agreement.jaccard_sum += jaccard(a, b)
            reason, peer_only, ours_only, gap = compare_row(
                a, b, peer_scores[layer, head], our_scores[layer, head], eps
            )
            if reason == "identical":
                agreement.identical += 1
                continue
            agreement.reasons[reason] += 1
            nested = reason == "kept count" and (not len(peer_only) or not len(ours_only))
            agreement.nested += int(nested)
            swapped = np.concatenate([peer_only, ours_only])
            agreement.diffs.append(
                RowDiff(
                    prompt,
                    layer,
                    head,
                    reason,
                    peer_only.tolist(),
                    ours_only.tolist(),
                    gap,
                    nested=nested,
                    peer_scores={int(i): float(peer_scores[layer, head, i]) for i in swapped},
                    our_scores={int(i): float(our_scores[layer, head, i]) for i in swapped},
                )
            )
    return agreement


def differences(agreement: Agreement) -> str:
    """The differing rows in words: each reason with its count."""
    if agreement.rows == agreement.identical:
        return "none"
    words = []
    for reason in REASONS:
        count = agreement.reasons[reason]
        if count:
            nested = f" ({agreement.nested} nested)" if reason == "kept count" else ""
            words.append(f"{reason}: {count}{nested}")
    return ", ".join(words)


def table(rows: list[tuple[str, str, str, Agreement]]) -> str:
    """The markdown table: per method, kvpress's press, kvbench's config, and how far they agree."""
    lines = [
        "| method | kvpress press | kvbench config | rows | identical | mean Jaccard | differing rows |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for method, press, config, a in rows:
        lines.append(
            f"| `{method}` | `{press}` | `{config}` | {a.rows} | {100 * a.identical_share:.1f} % | "
            f"{a.mean_jaccard:.4f} | {differences(a)} |"
        )
    return "\n".join(lines)


def unexplained_rows(method: str, agreement: Agreement, limit: int = 5) -> list[str]:
    """Up to ``limit`` unexplained rows in words: the swapped positions with kvpress's and kvbench's scores."""
    out = []
    for d in [d for d in agreement.diffs if d.reason == "unexplained"][:limit]:
        pairs = ", ".join(
            f"{i}: {d.peer_scores[i]:.6g} / {d.our_scores[i]:.6g}" for i in sorted(d.peer_only + d.ours_only)
        )
        out.append(
            f"- `{method}` prompt {d.prompt}, layer {d.layer}, head {d.head}: kvpress alone kept {d.peer_only}, "
            f"kvbench alone {d.ours_only}; gap {d.gap:.2g}; scores (kvpress / kvbench) {pairs}"
        )
    return out
