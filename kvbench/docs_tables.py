"""The policy and task tables (docs/policies.md, README.md), rendered from ``configs/`` so that they cannot drift
from what runs.

A group file's leading comment block describes it: the first sentence is its summary, and a line
``# paper: ...``, ``# kvpress: ...`` (the peer's press), ``# data: ...`` or ``# scored by: ...`` fills that
column (comments, so the configs keep only keys the schema knows). Each table sits in one of ``DOCUMENTS`` between
``<!-- BEGIN <name> ... -->`` and ``<!-- END <name> -->``. ``python -m kvbench.docs_tables`` exits 1 when
they differ from the configs; ``--write`` rewrites them. ``tests/test_docs.py`` runs the same comparison.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from kvbench.config.phases import CONFIG_DIR, named_policy
from kvbench.config.schema import PolicyConfig
from kvbench.config.store import defaults_node
from kvbench.policies.registry import build_policy
from kvbench.stages import Stage

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", "docs/policies.md")  # where the marked tables sit, relative to the repository
META_KEYS = ("paper", "kvpress", "data", "scored by")
# Where a dataset task's rows live: shown in the data column, not among the options.
HUB_KEYS = ("name", "source", "columns")
ARXIV = re.compile(r"arXiv:(\d{4}\.\d{4,5})")
# A sentence ends at a full stop followed by a space, except after the abbreviations the configs use.
SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)(?<!et al)\.(?:\s|$)")


@dataclass(frozen=True)
class Described:
    """One group file: what the command line names it (``policy=<choice>``), its values and its comment."""

    choice: str
    values: dict[str, Any]
    summary: str
    meta: dict[str, str]


def describe(path: Path, group_dir: Path) -> Described:
    lines = path.read_text(encoding="utf-8").splitlines()
    prose, meta = [], {}
    for line in lines:
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        key, _, value = text.partition(":")
        if key in META_KEYS:
            meta[key] = value.strip()
        else:
            prose.append(text)
    joined = " ".join(prose)
    end = SENTENCE_END.search(joined)
    summary = joined[: end.start() + 1] if end else joined
    choice = path.relative_to(group_dir).with_suffix("").as_posix()
    cfg = OmegaConf.load(path)
    assert isinstance(cfg, DictConfig)
    return Described(choice, shown_values(cfg), summary, meta)


def shown_values(cfg: DictConfig) -> dict[str, Any]:
    """The file's values, each interpolation resolved where the file alone resolves it (``${..score.window}``)
    and shown as written where it needs the run (``${model.name}``)."""

    def walk(node: dict[Any, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in node.items():
            if isinstance(value, dict):
                out[key] = walk(value, f"{prefix}{key}.")
            elif isinstance(value, str) and "${" in value:
                try:
                    out[key] = OmegaConf.select(cfg, f"{prefix}{key}", throw_on_resolution_failure=True)
                except InterpolationResolutionError:
                    out[key] = value
            else:
                out[key] = value
        return out

    raw = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(raw, dict)
    return walk(raw, "")


def shown(value: Any) -> str:
    """A value as YAML writes it: true, null, 0.5, [a, b], {k: v}."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {shown(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    return str(value)


def literal(text: str) -> str:
    """A path or an interpolation in code font, so that markdown leaves its characters alone."""
    return f"`{text}`" if "/" in text or "$" in text else text


def part(value: Any) -> str:
    """A policy part, ``kind`` or ``{kind: ..., options}``, as ``kind`` (option value, ...)."""
    if not isinstance(value, dict):
        return f"`{value}`"
    options = ", ".join(f"{key} {literal(shown(v))}" for key, v in value.items() if key != "kind")
    return f"`{value['kind']}`" + (f" ({options})" if options else "")


def cell(text: str) -> str:
    """Text for a table cell: pipes escaped, arXiv ids linked."""
    return ARXIV.sub(r"[arXiv:\1](https://arxiv.org/abs/\1)", text.replace("|", "\\|"))


def described(group: str, configs: Path) -> list[Described]:
    group_dir = configs / group
    return [describe(path, group_dir) for path in sorted(group_dir.rglob("*.yaml"))]


def policy_table(configs: Path) -> str:
    defaults = OmegaConf.to_container(defaults_node(PolicyConfig))
    assert isinstance(defaults, dict)
    rows = [
        "| policy | in short | stages | score | scope | allocation | paper | kvpress |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for d in described("policy", configs):
        parts = [part(d.values.get(name, defaults[name])) for name in ("score", "scope", "allocation")]
        channels = d.values.get("channels", defaults["channels"])
        if channels:  # the budget's other dimension: how much of each kept key is kept (policy.channels)
            parts[2] += f"; key channels {part(channels)}"
        paper, press = cell(d.meta.get("paper", "")), d.meta.get("kvpress", "")
        press = f"`{press}`" if press else ""
        runs = stages(defaults | d.values, d.choice, configs)
        rows.append(f"| `{d.choice}` | {cell(d.summary)} | {runs} | {' | '.join(parts)} | {paper} | {press} |")
    return "\n".join(rows)


def stages(values: dict[Any, Any], name: str, configs: Path) -> str:
    """The stages a policy config runs in, and its decode schedule when it does not evict at every step. A config
    that builds only inside a run (a profile path naming the model) is composed as a run composes it, from the
    repository root its relative paths point from; one that builds neither way gets an empty cell."""
    try:
        policy = build_policy(values)
    except (ValueError, KeyError, TypeError):
        if configs.resolve() != CONFIG_DIR.resolve():
            return ""
        here = Path.cwd()
        os.chdir(CONFIG_DIR.parent)
        try:
            policy = build_policy(named_policy(name))
        finally:
            os.chdir(here)
    runs = [s.value for s in Stage if s.value not in (policy.unsupported_stages or ())]
    every = f" (decode: every {policy.interval} steps)" if policy.interval > 1 and "decode" in runs else ""
    return ", ".join(runs) + every


def task_table(configs: Path) -> str:
    rows = ["| task | in short | data | scored by | options (defaults) |", "| --- | --- | --- | --- | --- |"]
    for d in described("task", configs):
        options = ", ".join(f"`{key}={shown(v)}`" for key, v in d.values.items() if key not in HUB_KEYS)
        meta = [cell(d.meta.get(key, "")) for key in ("data", "scored by")]
        rows.append(f"| `{d.choice}` | {cell(d.summary)} | {' | '.join(meta)} | {options} |")
    return "\n".join(rows)


TABLES: dict[str, Callable[[Path], str]] = {"policies": policy_table, "tasks": task_table}


def marked(name: str) -> re.Pattern[str]:
    return re.compile(rf"<!-- BEGIN {name} [^>]*-->\n(.*?)<!-- END {name} -->", re.DOTALL)


def render(text: str, configs: Path) -> str:
    """``text`` with every marked table it holds replaced by the one the configs give."""
    for name, table in TABLES.items():
        found = marked(name).search(text)
        if found:
            text = text[: found.start(1)] + table(configs) + "\n" + text[found.end(1) :]
    return text


def tables_in(text: str) -> set[str]:
    return {name for name in TABLES if marked(name).search(text)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite the tables in the documents")
    ap.add_argument("--root", type=Path, default=REPO, help="the repository whose documents hold the tables")
    ap.add_argument("--configs", type=Path, default=REPO / "configs")
    args = ap.parse_args(argv)
    stale, found = [], set()
    for document in DOCUMENTS:
        path = args.root / document
        text = path.read_text(encoding="utf-8")
        found |= tables_in(text)
        current = render(text, args.configs)
        if current != text:
            stale.append(path)
            if args.write:
                path.write_text(current, encoding="utf-8")
                print(f"rewrote the tables in {path}")
    missing = sorted(set(TABLES) - found)
    if missing:
        raise ValueError(f"no '<!-- BEGIN {missing[0]} ... -->' ... '<!-- END {missing[0]} -->' markers in {DOCUMENTS}")
    if stale and not args.write:
        shown = ", ".join(str(p) for p in stale)
        print(f"{shown}: the generated tables are stale; run python -m kvbench.docs_tables --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
