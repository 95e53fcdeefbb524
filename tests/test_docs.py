"""The documents stay true to the repository: the README's tables are the configs', every local link and named
path resolves, and the docs index lists every document."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from conftest import CONFIG_DIR, REPO
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvbench.docs_tables import DOCUMENTS, described, main, render, tables_in

README = REPO / "README.md"
DOCS = REPO / "docs"
MARKDOWN = sorted([README, *DOCS.rglob("*.md"), *REPO.glob("results/*/README.md")])
# Written in parallel with this index and linked from it before it lands; remove once docs/architecture.md exists.
# Guides that name the files their reader creates: only the tests and scripts they name must exist already.
NAMES_NEW_FILES = {DOCS / "extending.md"}

CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
NAMED_PATH = re.compile(r"`((?:kvbench|tests|scripts|configs|docs)/[\w./-]+)`")
HEADING = re.compile(r"^#{1,6} (.+)$", re.MULTILINE)


def test_the_generated_tables_are_the_configs():
    found = set()
    for document in DOCUMENTS:
        text = (REPO / document).read_text(encoding="utf-8")
        found |= tables_in(text)
        assert render(text, CONFIG_DIR) == text, (
            f"{document}'s policy or task table differs from configs/: run python -m kvbench.docs_tables --write"
        )
    assert found == {"policies", "tasks"}


def test_a_new_or_changed_config_changes_the_tables(tmp_path):
    """The check above fails for documents that were not regenerated after a config changed."""
    configs = tmp_path / "configs"
    for group in ("policy", "task"):
        shutil.copytree(CONFIG_DIR / group, configs / group)
    (configs / "policy" / "keydiff.yaml").write_text(
        "# KeyDiff: keep the keys least similar to the mean key.\n# paper: Park et al. 2025, arXiv:2504.15364\n"
        "name: keydiff\nscore: key_diff\nscope: all\n"
    )
    h2o = configs / "policy" / "h2o.yaml"
    h2o.write_text(h2o.read_text().replace("window: 0.5", "window: 0.25"))
    think = configs / "policy" / "think.yaml"
    think.write_text(think.read_text().replace("ratio: 0.5 ", "ratio: 0.25 "))
    for document in DOCUMENTS:
        (tmp_path / document).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / document).write_text((REPO / document).read_text(encoding="utf-8"), encoding="utf-8")
    root = ["--root", str(tmp_path), "--configs", str(configs)]

    assert main(root) == 1
    assert main([*root, "--write"]) == 0
    text = (tmp_path / "docs" / "policies.md").read_text(encoding="utf-8")
    assert (
        "| `keydiff` | KeyDiff: keep the keys least similar to the mean key. |  | `key_diff` | `all` | `uniform` | "
        "Park et al. 2025, [arXiv:2504.15364](https://arxiv.org/abs/2504.15364) |" in text
    )
    assert "`sinks_window` (n_sink 0, window 0.25)" in text
    assert "| `all` | `uniform`; key channels `think` (ratio 0.25, window 32) |" in text  # policy.channels shown
    assert main(root) == 0


def test_documents_without_the_markers_are_refused(tmp_path):
    for document in DOCUMENTS:
        (tmp_path / document).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / document).write_text("# no tables here\n")
    with pytest.raises(ValueError, match="<!-- BEGIN policies"):
        main(["--root", str(tmp_path)])


@pytest.mark.parametrize("group", ["policy", "task"])
def test_every_config_describes_itself(group):
    """A summary for every row; tasks also say what data they read and how they are scored."""
    for d in described(group, CONFIG_DIR):
        assert d.summary.endswith("."), f"configs/{group}/{d.choice}.yaml: start it with a one-sentence comment"
        if group == "task":
            assert d.meta.get("data") and d.meta.get("scored by"), (
                f"configs/task/{d.choice}.yaml: add '# data: ...' and '# scored by: ...' comment lines"
            )


def test_every_described_config_still_composes():
    """The comments the tables read are comments: each file composes as before, its values intact."""
    for group in ("policy", "task"):
        for d in described(group, CONFIG_DIR):
            with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
                cfg = compose("config", overrides=["model=tiny-llama", f"{group}={d.choice}"])
            node = OmegaConf.to_container(cfg[group])
            assert isinstance(node, dict)
            written = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / group / f"{d.choice}.yaml"))
            assert isinstance(written, dict)
            assert {key: node[key] for key in written} == written, f"{group}={d.choice}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    return {slug(CODE.sub(lambda m: m.group(0).strip("`"), h)) for h in HEADING.findall(text)}


def local_links(path: Path) -> list[str]:
    prose = CODE.sub("", path.read_text(encoding="utf-8"))
    return [t for t in LINK.findall(prose) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_every_local_link_resolves(doc):
    broken = []
    for target in local_links(doc):
        file, _, anchor = target.partition("#")
        resolved = (doc.parent / file).resolve() if file else doc
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{doc.relative_to(REPO)}: " + ", ".join(broken)


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_a_document_names_exists(doc):
    """A file named in code font (`tests/engine/test_batches.py`) must be where the document says."""
    named = NAMED_PATH.findall(doc.read_text(encoding="utf-8"))
    if doc in NAMES_NEW_FILES:
        named = [p for p in named if p.startswith(("tests/", "scripts/"))]
    missing = [p for p in named if not (REPO / p).exists()]
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist: {', '.join(missing)}"


def test_the_docs_index_lists_every_document():
    index = DOCS / "README.md"
    linked = {(index.parent / target.partition("#")[0]).resolve() for target in local_links(index)}
    documents = {p.resolve() for p in MARKDOWN if p not in (README, index)}
    assert not documents - linked, f"add to docs/README.md: {sorted(str(p) for p in documents - linked)}"
    assert "docs/README.md" in local_links(README), "link docs/README.md from README.md"
