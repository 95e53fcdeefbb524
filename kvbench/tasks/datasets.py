"""Shared plumbing of the dataset-backed tasks: records, sampling, and the context/question split.

Records come from the Hugging Face hub or, for offline runs, from local JSONL files that use the
hub's field names: ``DIR/<split>.jsonl`` for xsum and cnn_dailymail, ``DIR/<subset>.jsonl`` for
LongBench (whose only split is ``test``). Rendering (``prompting.render_prompt``) turns "context part +
question part" into token ids: chat template, middle truncation, and the split the engine compresses around.
"""

from __future__ import annotations

import json
import random
import zipfile
from abc import abstractmethod
from pathlib import Path, PurePosixPath
from typing import Any

from kvbench.tasks.base import Example, RenderedPrompt, Task
from kvbench.tasks.jsonl import parse_line
from kvbench.tasks.prompting import render_prompt

# Hub repository and config of each summarisation dataset.
SUMMARIZATION_HUB: dict[str, tuple[str, str | None]] = {
    "xsum": ("EdinburghNLP/xsum", None),
    "cnn_dailymail": ("abisee/cnn_dailymail", "3.0.0"),
}
# LongBench v1 ships a loading script (which datasets>=4 refuses to run) next to data.zip of JSONL.
LONGBENCH_REPO = "THUDM/LongBench"
LONGBENCH_ARCHIVE = "data.zip"
LONGBENCH_SUBSETS = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "multifieldqa_zh",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "dureader",
    "gov_report",
    "qmsum",
    "multi_news",
    "vcsum",
    "trec",
    "triviaqa",
    "samsum",
    "lsht",
    "passage_count",
    "passage_retrieval_en",
    "passage_retrieval_zh",
    "lcc",
    "repobench-p",
)
HUB_PROBE_TIMEOUT_S = 5.0


# ---------------------------------------------------------------- records


def load_records(
    dataset: str, split: str = "test", data_dir: str | Path | None = None, subset: str | None = None
) -> list[dict[str, Any]]:
    """All rows of one split (``dataset`` is ``xsum``, ``cnn_dailymail`` or ``longbench``)."""
    label, stem = _describe(dataset, split, subset)
    if data_dir is not None:
        return read_jsonl(_local_file(data_dir, label, stem))
    _require_hub(label, stem)
    try:
        if dataset == "longbench":
            from huggingface_hub import hf_hub_download

            archive = hf_hub_download(LONGBENCH_REPO, LONGBENCH_ARCHIVE, repo_type="dataset")
            return load_longbench_archive(archive, stem)
        return _summarization_from_hub(dataset, split)
    except (OSError, RuntimeError, ValueError) as err:  # hub and cache errors are OSErrors
        raise _missing(label, stem, f"{type(err).__name__}: {err}") from err


def check_records(
    dataset: str, split: str = "test", data_dir: str | Path | None = None, subset: str | None = None
) -> None:
    """Cheap check, reading no data: valid names, and the local file exists or the hub answers."""
    label, stem = _describe(dataset, split, subset)
    if data_dir is not None:
        _local_file(data_dir, label, stem)
    else:
        _require_hub(label, stem)


def _describe(dataset: str, split: str, subset: str | None) -> tuple[str, str]:
    """A label for messages and the file stem: the split, or the LongBench subset."""
    if dataset == "longbench":
        if subset not in LONGBENCH_SUBSETS:
            raise ValueError(f"unknown LongBench subset {subset!r}; choose one of {list(LONGBENCH_SUBSETS)}")
        if split != "test":
            raise ValueError(f"LongBench has only a 'test' split, not {split!r}")
        return f"longbench/{subset}", subset
    if dataset not in SUMMARIZATION_HUB:
        raise ValueError(f"unknown dataset {dataset!r}")
    return f"{dataset} split {split!r}", split


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


def _require_hub(label: str, stem: str) -> None:
    if not _hub_offline() and not _hub_reachable():
        raise _missing(label, stem, "the hub is unreachable")


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


def load_longbench_archive(archive: str | Path, subset: str) -> list[dict[str, Any]]:
    """Rows of ``<subset>.jsonl`` inside LongBench's ``data.zip``, read straight from the archive so that a
    cached archive also works with the hub offline."""
    with zipfile.ZipFile(archive) as zf:
        members = [m for m in zf.namelist() if PurePosixPath(m).name == f"{subset}.jsonl"]
        if not members:
            raise FileNotFoundError(f"{archive} has no {subset}.jsonl")
        text = zf.read(members[0]).decode("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _summarization_from_hub(dataset: str, split: str) -> list[dict[str, Any]]:
    import datasets

    repo, config = SUMMARIZATION_HUB[dataset]
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


class DatasetTask(Task):
    """A task over dataset rows: sampling, the context/question split and rendering are shared."""

    subset: str | None = None

    def __init__(
        self,
        split: str = "test",
        n: int | None = 20,
        seed: int = 0,
        data_dir: str | None = None,
        max_prompt_tokens: int | None = 3500,
        max_new_tokens: int | None = None,
        chat_template: bool = True,
        question_aware: bool = True,
    ) -> None:
        self.split = split
        self.n = n
        self.seed = seed
        self.data_dir = data_dir
        self.max_prompt_tokens = max_prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.chat_template = chat_template
        self.question_aware = question_aware

    @abstractmethod
    def make_example(self, record: dict[str, Any], index: int) -> Example:
        """One row as an example; build it with :meth:`compose`."""

    def validate(self) -> None:
        check_records(self.name, self.split, self.data_dir, self.subset)

    def records(self) -> list[dict[str, Any]]:
        """Every row of the configured split (the task's registered name is the loader's)."""
        return load_records(self.name, self.split, self.data_dir, self.subset)

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
