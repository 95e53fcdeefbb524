"""``kvbench-report RESULTS_DIR... [--out DIR] [--metric NAME] [--paired POLICY] [--baseline POLICY]``: the
command-line entry point."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvbench.report.aggregate import N_BOOT
from kvbench.report.build import build_report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbench-report",
        description="Figures, tables and report.md from every rows.jsonl under the given result directories.",
    )
    parser.add_argument("results", nargs="+", type=Path, metavar="RESULTS_DIR")
    parser.add_argument(
        "--out",
        type=Path,
        help="output directory (default: RESULTS_DIR/report for one directory, ./report for several)",
    )
    parser.add_argument("--metric", help="metric to plot instead of each task's primary metric, e.g. fidelity_kl")
    parser.add_argument("--bootstrap", type=int, default=N_BOOT, help="bootstrap resamples per cell")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    parser.add_argument(
        "--paired",
        action="append",
        default=[],
        metavar="POLICY",
        help="also compare every policy with POLICY example by example (paired bootstrap); repeatable; "
        "the config name or the display name, any case (snapkv, SnapKV)",
    )
    parser.add_argument(
        "--baseline",
        metavar="POLICY",
        help="the policy the leaderboard's table compares every other with (default: the full cache); "
        "the config name or the display name, any case (snapkv, SnapKV)",
    )
    return parser


def default_out(results: Sequence[Path]) -> Path:
    """RESULTS_DIR/report for a single directory, ./report when several are combined."""
    if len(results) == 1 and results[0].is_dir():
        return results[0] / "report"
    return Path("report")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    absent = [str(p) for p in args.results if not p.exists()]
    if absent:
        print(f"kvbench-report: no such path: {', '.join(absent)}", file=sys.stderr)
        return 2
    try:
        build_report(
            args.results,
            args.out or default_out(args.results),
            args.metric,
            args.bootstrap,
            args.seed,
            paired=args.paired,
            baseline=args.baseline,
        )
    except ValueError as error:
        print(f"kvbench-report: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
