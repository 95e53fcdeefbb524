"""Shared plumbing of the dataset-backed tasks: records, sampling, and the context/question split.

Records come from the Hugging Face hub, as the task's config declares (``source``: the dataset's id and config,
or a zip of JSONL files in it; ``columns``: which column holds what), or, for offline runs, from local JSONL files
that use the hub's column names: ``DIR/<split>.jsonl`` for xsum and cnn_dailymail, ``DIR/<subset>.jsonl`` for
LongBench (whose only split is ``test``). Rendering (``prompting.render_prompt``) turns "context part +
question part" into token ids: chat template, middle truncation, and the split the engine compresses around.
"""

from __future__ import annotations

import json
import random
import zipfile
from abc import abstractmethod
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

from kvbench.tasks.base import Example, RenderedPrompt, Task, TaskError
from kvbench.tasks.jsonl import parse_line
from kvbench.tasks.prompting import render_prompt

HUB_PROBE_TIMEOUT_S = 5.0


# ---------------------------------------------------------------- records


@dataclass
class HubSource:
    """Where a dataset task's rows live on the Hugging Face hub; declared in the task's config (``source:``)."""

    repo: str | None = None  # the hub dataset's id; None: local files only (task.data_dir)
    config: str | None = None  # the dataset's config name, for datasets.load_dataset
    archive: str | None = None  # a zip of <file>.jsonl in the repository, read instead (LongBench's data.zip)


@dataclass
class Columns:
    """Which column of a row holds what; declared in the task's config (``columns:``)."""

    text: str = "text"  # the document or context
    reference: str | None = None  # the reference answer: a string, or a list of them
    question: str | None = None  # what is asked about the text
    id: str | None = None  # the row's id (None or absent: its index)


def load_records(source: HubSource, stem: str, label: str, split: str, data_dir: str | None) -> list[dict[str, Any]]:
    """Every row of ``<data_dir>/<stem>.jsonl``, or from the hub: ``stem``.jsonl of the source's archive, or the
    dataset's ``split``. ``label`` names the rows in messages."""
    if data_dir is not None:
        return read_jsonl(_local_file(data_dir, label, stem))
    check_records(source, stem, label, data_dir)
    assert source.repo is not None  # checked
    try:
        if source.archive:
            from huggingface_hub import hf_hub_download

            return load_archive(hf_hub_download(source.repo, source.archive, repo_type="dataset"), stem)
        return _from_hub(source.repo, source.config, split)
    except (OSError, RuntimeError, ValueError) as err:  # hub and cache errors are OSErrors
        raise _missing(label, stem, f"{type(err).__name__}: {err}") from err


def check_records(source: HubSource, stem: str, label: str, data_dir: str | None) -> None:
    """Cheap check, reading no data: the local file exists, or a hub dataset is declared and the hub answers."""
    if data_dir is not None:
        _local_file(data_dir, label, stem)
    elif source.repo is None:
        raise _missing(label, stem, "the task's config declares no hub dataset (source.repo)")
    elif not _hub_offline() and not _hub_reachable():
        raise _missing(label, stem, "the hub is unreachable")


def _local_file(data_dir: str | Path, label: str, stem: str) -> Path:
    path = Path(data_dir).expanduser() / f"{stem}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{label}: {path} does not exist. Set task.data_dir=... to a folder holding {stem}.jsonl "
            "(one JSON object a line, hub field names)."
        )
    return path


def _missing(label: str, stem: str, why: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{label}: cannot load it from the Hugging Face hub ({why}). Set task.data_dir=... to a folder "
        f"holding {stem}.jsonl (one JSON object a line, hub field names), or set HF_HUB_OFFLINE=1 to "
        "use a copy already in the hub cache."
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every line of a local JSONL file as a JSON object; a bad line is refused with its file and line number."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [parse_line(line, f"{path}:{number}") for number, line in enumerate(lines, 1) if line.strip()]


def sample_indices(total: int, n: int | None, seed: int) -> list[int]:
    """``n`` row indices drawn by ``seed``, in file order; ``n=None`` (or n >= total) keeps every row."""
    if n is None or n >= total:
        return list(range(total))
    if n < 0:
        raise ValueError(f"n must be >= 0 or null, got {n}")
    return sorted(random.Random(seed).sample(range(total), n))


def load_archive(archive: str | Path, stem: str) -> list[dict[str, Any]]:
    """Rows of ``<stem>.jsonl`` inside a zip (LongBench's ``data.zip``), read straight from the archive so that a
    cached archive also works with the hub offline."""
    with zipfile.ZipFile(archive) as zf:
        members = [m for m in zf.namelist() if PurePosixPath(m).name == f"{stem}.jsonl"]
        if not members:
            raise FileNotFoundError(f"{archive} has no {stem}.jsonl")
        text = zf.read(members[0]).decode("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _from_hub(repo: str, config: str | None, split: str) -> list[dict[str, Any]]:
    import datasets

    try:
        return datasets.load_dataset(repo, config, split=split).to_list()
    except RuntimeError as err:
        # A repository that still holds a loading script: its parquet export runs without one.
        if "script" not in str(err):
            raise
        return datasets.load_dataset(repo, config, split=split, revision="refs/convert/parquet").to_list()


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE): the libraries then read only their caches."""
    import datasets
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE)


def _hub_reachable() -> bool:
    """One short request, so an unreachable hub fails in seconds, not after half a minute of retries."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S)
    except Exception:  # any transport failure means "not reachable"
        return False
    return True


# ---------------------------------------------------------------- base task


@dataclass
class DatasetTask(Task):
    """A task over dataset rows: loading, sampling, the context/question split and rendering are shared. Where
    the rows live (``source``) and which columns hold what (``columns``) come from the task's config."""

    source: HubSource = field(default_factory=HubSource)
    columns: Columns = field(default_factory=Columns)
    split: str = "test"
    n: int | None = 20
    seed: int = 0
    data_dir: str | None = None  # a folder of <split>.jsonl files in the hub's column names; None: the hub
    max_prompt_tokens: int | None = 3500
    max_new_tokens: int | None = None  # None: the task's own
    chat_template: bool = True
    question_aware: bool = True  # false: the question is fed after the context is compressed

    # The columns a row must have, named in the config (``columns.<role>``).
    required_columns: ClassVar[tuple[str, ...]] = ("text", "reference")

    def __post_init__(self) -> None:
        unnamed = [role for role in self.required_columns if getattr(self.columns, role) is None]
        if unnamed:
            raise TaskError(f"task.columns.{unnamed[0]} must name the rows' {unnamed[0]} column")

    def file_stem(self) -> str:
        """The name of the rows' file, locally and in an archive: the split."""
        return self.split

    def label(self) -> str:
        """The rows' name in messages."""
        return f"{self.name} split {self.split!r}"

    @abstractmethod
    def make_example(self, record: dict[str, Any], index: int) -> Example:
        """One row as an example; build it with :meth:`compose`."""

    def validate(self) -> None:
        check_records(self.source, self.file_stem(), self.label(), self.data_dir)

    def records(self) -> list[dict[str, Any]]:
        """Every row of the configured split."""
        return load_records(self.source, self.file_stem(), self.label(), self.split, self.data_dir)

    def examples(self) -> list[Example]:
        rows = self.records()
        return [self.make_example(rows[i], i) for i in sample_indices(len(rows), self.n, self.seed)]

    def compose(
        self, example_id: str, context_part: str, question_part: str, references: list[str], meta: dict[str, Any]
    ) -> Example:
        """The user text is always ``prompt + question``; ``question`` is set only when it is fed apart."""
        if self.question_aware:
            return Example(id=example_id, prompt=context_part + question_part, references=references, meta=meta)
        return Example(id=example_id, prompt=context_part, question=question_part, references=references, meta=meta)

    def uses_chat(self, example: Example, tokenizer: Any) -> bool:
        return bool(self.chat_template and getattr(tokenizer, "chat_template", None))

    def render(self, example: Example, tokenizer: Any) -> RenderedPrompt:
        return render_prompt(
            tokenizer,
            example.prompt,
            example.question,
            chat=self.uses_chat(example, tokenizer),
            max_prompt_tokens=self.max_prompt_tokens,
        )
