"""Dataset loading, sampling and prompt rendering of the xsum, cnn_dailymail and longbench tasks.

Real samples are read from ``shared/data`` beside the repository; tokenizers are built offline.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, SHARED_DATA, task_from_config
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from kvbench.tasks import datasets as data
from kvbench.tasks.longbench import SUBSETS, LongBench
from kvbench.tasks.registry import build_task

ROOT = REPO
DATA = SHARED_DATA
needs_data = pytest.mark.skipif(
    not (DATA / "longbench").is_dir(), reason=f"sample data not found at {DATA} (shared/data beside the repository)"
)

CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TRIMMING_CHAT = CHAT.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")


def make_tokenizer(chat_template: str | None = CHAT) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here on a few strings: merges cross the context/question boundary."""
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "The owners said their planned development would create jobs.\n\nQuestion: What is it?\nAnswer:",
        "Summarise the article above in a single sentence.\nSummary:",
        "问题：答案：北京大学。",
    ] * 5
    model.train_from_iterator(corpus, trainer)
    model.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>")
    tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return make_tokenizer()


def full_ids(tokenizer: Any, user_text: str, chat: bool) -> list[int]:
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(user_text, add_special_tokens=True)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def longbench_row(i: int, **extra: Any) -> dict[str, Any]:
    row = {
        "input": f"Who wrote note {i}?",
        "context": f"Passage {i}: Ann wrote note {i}. " * 30,
        "answers": [f"Ann {i}"],
        "length": 200,
        "dataset": "hotpotqa",
        "language": "en",
        "all_classes": None,
        "_id": f"id{i}",
    }
    return {**row, **extra}


# ---------------------------------------------------------------- loading


@needs_data
def test_summarization_datasets_load_from_shared_data() -> None:
    xsum = task_from_config("xsum", data_dir=str(DATA / "xsum"), n=None)
    rows = data.read_jsonl(DATA / "xsum" / "test.jsonl")
    examples = xsum.examples()
    assert len(examples) == len(rows) == 1000
    assert examples[0].id == rows[0]["id"] and examples[0].references == [rows[0]["summary"]]
    assert rows[0]["document"].strip() in examples[0].prompt
    cnn = task_from_config("cnn_dailymail", data_dir=str(DATA / "cnn_dailymail"), split="validation", n=3)
    first = cnn.examples()[0]
    assert len(cnn.examples()) == 3 and "\n" in first.references[0]  # highlights joined by newlines
    assert len(task_from_config("cnn_dailymail", data_dir=str(DATA / "cnn_dailymail"), n=None).examples()) == 344


@needs_data
@pytest.mark.parametrize("subset", ["trec", "multifieldqa_zh", "passage_retrieval_zh", "samsum", "lcc", "gov_report"])
def test_longbench_subsets_load_from_shared_data(subset: str) -> None:
    rows = data.read_jsonl(DATA / "longbench" / f"{subset}.jsonl")
    examples = task_from_config("longbench", subset=subset, data_dir=str(DATA / "longbench"), n=None).examples()
    assert len(examples) == len(rows)
    assert [e.references for e in examples] == [r["answers"] for r in rows]
    assert all(r["context"] in e.prompt for e, r in zip(examples, rows))
    assert len({e.id for e in examples}) == len(examples)
    if subset == "trec":
        assert "Individual" in examples[0].meta["all_classes"]


def test_local_hub_format_files(tmp_path: Path) -> None:
    write_jsonl(
        tmp_path / "test.jsonl", [{"document": f"Doc {i}.", "summary": f"Sum {i}.", "id": str(i)} for i in range(5)]
    )
    write_jsonl(tmp_path / "hotpotqa.jsonl", [longbench_row(i) for i in range(4)])
    xs = task_from_config("xsum", data_dir=str(tmp_path), n=None).examples()
    assert [e.id for e in xs] == ["0", "1", "2", "3", "4"] and xs[2].references == ["Sum 2."]
    lb = task_from_config("longbench", subset="hotpotqa", data_dir=str(tmp_path), n=2, seed=3).examples()
    assert len(lb) == 2 and all(e.id.startswith("id") for e in lb)


def test_the_config_declares_where_the_rows_live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub id, config, archive and columns reach the loader from the task's config, not from a table."""
    import datasets
    import huggingface_hub

    asked = []

    hub = {
        "EdinburghNLP/xsum": [{"document": "Doc.", "summary": "Sum.", "id": "x"}],
        "abisee/cnn_dailymail": [{"article": "Art.", "highlights": "H.", "id": "y"}],
        "me/xsum-mirror": [{"document": "Doc.", "summary": "Sum."}] * 2,
    }

    class Rows(list):
        def to_list(self) -> list[dict[str, Any]]:
            return list(self)

    def load_dataset(repo: str, config: str | None, split: str, **kw: Any) -> Rows:
        asked.append((repo, config, split))
        return Rows(hub[repo])

    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("data/hotpotqa.jsonl", json.dumps(longbench_row(7)) + "\n")

    def download(repo: str, filename: str, repo_type: str) -> str:
        asked.append((repo, filename, repo_type))
        return str(archive)

    monkeypatch.setattr(data, "_hub_offline", lambda: True)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    (doc,) = task_from_config("xsum", n=None).examples()
    assert doc.id == "x" and doc.references == ["Sum."] and "Doc." in doc.prompt
    (art,) = task_from_config("cnn_dailymail", split="validation", n=None).examples()
    assert art.id == "y" and art.references == ["H."] and "Art." in art.prompt
    (row,) = task_from_config("longbench", subset="hotpotqa", n=None).examples()
    assert row.id == "id7" and row.references == ["Ann 7"] and "Who wrote note 7?" in row.prompt
    columns = {"text": "summary", "reference": "summary", "id": None}
    mirror = task_from_config("xsum", n=None, source={"repo": "me/xsum-mirror"}, columns=columns)
    rows = mirror.examples()
    assert [(ex.id, ex.references) for ex in rows] == [("0", ["Sum."]), ("1", ["Sum."])]
    assert "Article:\nSum." in rows[0].prompt  # the text column as the override says
    assert asked == [
        ("EdinburghNLP/xsum", None, "test"),
        ("abisee/cnn_dailymail", "3.0.0", "validation"),
        ("THUDM/LongBench", "data.zip", "dataset"),
        ("me/xsum-mirror", None, "test"),
    ]


def test_sampling_is_deterministic_by_seed(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "test.jsonl", [{"document": "d", "summary": "s", "id": str(i)} for i in range(50)])

    def ids(**kw: Any) -> list[str]:
        return [e.id for e in task_from_config("xsum", data_dir=str(tmp_path), **kw).examples()]

    assert ids(n=7, seed=1) == ids(n=7, seed=1)
    assert ids(n=7, seed=1) != ids(n=7, seed=2)
    assert len(ids(n=7, seed=1)) == 7 and ids(n=None) == [str(i) for i in range(50)]
    assert ids(n=500) == ids(n=None)
    assert data.sample_indices(10, 3, 0) == sorted(data.sample_indices(10, 3, 0))


def test_missing_local_file_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"task\.data_dir=.*test\.jsonl"):
        task_from_config("xsum", data_dir=str(tmp_path)).validate()
    with pytest.raises(FileNotFoundError, match=r"task\.data_dir=.*qasper\.jsonl"):
        task_from_config("longbench", subset="qasper", data_dir=str(tmp_path)).examples()


def test_a_bad_line_of_a_local_file_names_its_file_and_line(tmp_path: Path) -> None:
    good = json.dumps({"id": "a", "document": "Some text.", "summary": "Text."})
    (tmp_path / "test.jsonl").write_text(f"{good}\n\n{{not json\n")
    with pytest.raises(ValueError, match=r"test\.jsonl:3: not valid JSON .*fix or remove the line"):
        task_from_config("xsum", data_dir=str(tmp_path)).examples()
    (tmp_path / "test.jsonl").write_text(f"{good}\n[1, 2]\n")
    with pytest.raises(ValueError, match=r"test\.jsonl:2: each line must be one JSON object"):
        task_from_config("xsum", data_dir=str(tmp_path)).examples()


def test_unreachable_hub_fails_fast_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "_hub_offline", lambda: False)
    monkeypatch.setattr(data, "_hub_reachable", lambda: False)
    for task in (
        task_from_config("xsum"),
        task_from_config("cnn_dailymail"),
        task_from_config("longbench", subset="lsht"),
    ):
        with pytest.raises(FileNotFoundError, match=r"unreachable.*task\.data_dir="):
            task.validate()


def test_offline_hub_with_empty_cache_fails_with_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import datasets
    from huggingface_hub import constants

    # What HF_HUB_OFFLINE=1 sets in both libraries (each reads it once, at import).
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    for task in (task_from_config("xsum"), task_from_config("longbench", subset="trec")):
        task.validate()  # offline mode skips the reachability probe and trusts the cache
        with pytest.raises(FileNotFoundError, match=r"cannot load it from the Hugging Face hub.*task\.data_dir="):
            task.examples()


def test_bad_options() -> None:
    with pytest.raises(ValueError, match=r"task\.columns\.reference must name the rows' reference column"):
        task_from_config("xsum", columns={"text": "document"})
    with pytest.raises(ValueError, match="subset"):
        task_from_config("longbench", subset="nope")
    with pytest.raises(ValueError, match="only a 'test' split"):
        task_from_config("longbench", split="validation", subset="trec", data_dir=".")


@needs_data
def test_longbench_archive_is_read(tmp_path: Path) -> None:
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name in ("trec", "trec_e", "multifieldqa_zh"):
            source = DATA / "longbench" / f"{name}.jsonl"
            zf.writestr(f"data/{name}.jsonl", source.read_text(encoding="utf-8") if source.exists() else "")
    for subset in ("trec", "multifieldqa_zh"):
        rows = data.load_archive(archive, subset)
        assert rows == data.read_jsonl(DATA / "longbench" / f"{subset}.jsonl")
    with pytest.raises(FileNotFoundError):
        data.load_archive(archive, "qasper")


# ---------------------------------------------------------------- configs


@pytest.mark.parametrize("name", ["xsum", "cnn_dailymail", "longbench"])
def test_config_files_build_their_task(name: str) -> None:
    cfg = yaml.safe_load((ROOT / "configs" / "task" / f"{name}.yaml").read_text())
    task = build_task(cfg)
    assert task.name == name and task.n == cfg["n"] and task.data_dir is None


# ---------------------------------------------------------------- rendering


def test_question_split_concatenates_to_the_whole_prompt(tok: PreTrainedTokenizerFast) -> None:
    row = longbench_row(1)
    for chat_tok, subset in (
        (tok, "hotpotqa"),
        (tok, "trec"),
        (make_tokenizer(TRIMMING_CHAT), "hotpotqa"),
        (make_tokenizer(None), "hotpotqa"),
    ):
        split = task_from_config("longbench", subset=subset, question_aware=False)
        whole = task_from_config("longbench", subset=subset, question_aware=True)
        ex_split, ex_whole = split.make_example(row, 0), whole.make_example(row, 0)
        assert ex_split.prompt + ex_split.question == ex_whole.prompt and ex_whole.question == ""
        chat = subset != "trec" and chat_tok.chat_template is not None
        expected = full_ids(chat_tok, ex_whole.prompt, chat)
        r_split, r_whole = split.render(ex_split, chat_tok), whole.render(ex_whole, chat_tok)
        assert r_split.input_ids + r_split.suffix_ids == expected == r_whole.input_ids
        assert r_whole.suffix_ids == [] and r_split.suffix_ids
        suffix = chat_tok.decode(r_split.suffix_ids)
        assert "Who wrote note 1?" in suffix and "Who wrote note 1?" not in chat_tok.decode(r_split.input_ids)
        assert ("<|assistant|>" in suffix) == chat
        assert not r_split.truncated and r_split.n_prompt_tokens_raw == len(expected)


def test_split_inside_a_merged_token(tok: PreTrainedTokenizerFast) -> None:
    # "development" is one token of this vocabulary, so tokenising the two pieces apart would not
    # give the whole prompt's ids; the split falls before the token that straddles the boundary.
    context, question = "The owners said their planned develop", "ment would create jobs."
    whole = tok.encode(context + question, add_special_tokens=True)
    assert whole != tok.encode(context, add_special_tokens=True) + tok.encode(question, add_special_tokens=False)
    r = data.render_prompt(tok, context, question, chat=False, max_prompt_tokens=None)
    assert r.input_ids + r.suffix_ids == whole
    assert tok.decode(r.suffix_ids).endswith("ment would create jobs.")
    assert tok.decode(r.input_ids, skip_special_tokens=True).startswith("The owners said their planned")


def test_chat_template_switches(tok: PreTrainedTokenizerFast) -> None:
    row = longbench_row(2)
    for task, chat in (
        (task_from_config("longbench", subset="hotpotqa"), True),
        (task_from_config("longbench", subset="hotpotqa", chat_template=False), False),
        (task_from_config("longbench", subset="lcc"), False),
        (task_from_config("longbench", subset="samsum"), False),
    ):
        ids = task.render(task.make_example(row, 0), tok).input_ids
        assert (tok.decode(ids[:1]) == "<|user|>") == chat
        assert (ids[0] == tok.bos_token_id) != chat


def test_middle_truncation(tok: PreTrainedTokenizerFast) -> None:
    task = task_from_config("longbench", subset="hotpotqa", question_aware=False, max_prompt_tokens=201)
    example = task.make_example(longbench_row(3), 0)
    whole = full_ids(tok, example.prompt + example.question, chat=True)
    assert len(whole) > 201
    r = task.render(example, tok)
    kept = r.input_ids + r.suffix_ids
    assert kept == whole[:100] + whole[len(whole) - 101 :]
    assert r.truncated and r.n_prompt_tokens_raw == len(whole)
    # The question sits in the kept tail, so it is still fed apart, after the context.
    assert tok.decode(r.suffix_ids).startswith("Question: Who wrote note 3?")
    assert not task_from_config("longbench", subset="hotpotqa", max_prompt_tokens=10_000).render(example, tok).truncated
    # A limit shorter than the question: the kept tail is all suffix, the kept head all context.
    tiny = task_from_config("longbench", subset="hotpotqa", question_aware=False, max_prompt_tokens=20).render(
        example, tok
    )
    assert tiny.input_ids == whole[:10] and tiny.suffix_ids == whole[-10:]


def test_xsum_render_and_score(tok: PreTrainedTokenizerFast) -> None:
    task = task_from_config("xsum", question_aware=False)
    ex = task.make_example({"document": "The owners said jobs.", "summary": "Jobs are coming.", "id": "9"}, 0)
    r = task.render(ex, tok)
    assert r.input_ids + r.suffix_ids == full_ids(tok, ex.prompt + ex.question, chat=True)
    assert "Summarise the article" in tok.decode(r.suffix_ids)
    scores = task.score(task.postprocess("  Jobs are coming.\n", ex), ex)
    assert scores[task.primary_metric] == pytest.approx(1.0)
    assert task.generation(ex).max_new_tokens == 64
    assert task_from_config("cnn_dailymail").primary_metric == "rougeLsum"


# ---------------------------------------------------------------- LongBench task behaviour


def test_longbench_generation_postprocess_and_score() -> None:
    trec = task_from_config("longbench", subset="trec")
    ex = trec.make_example(longbench_row(0, answers=["Individual"], all_classes=["Individual", "City"]), 0)
    assert trec.postprocess("\nIndividual\nQuestion: next", ex) == "Individual"
    assert trec.score(trec.postprocess("\nIndividual\nCity", ex), ex) == {"score": 1.0, "classification_score": 1.0}
    narrative = task_from_config("longbench", subset="narrativeqa")
    assert narrative.postprocess("a\nb", ex) == "a\nb"
    samsum = task_from_config("longbench", subset="samsum").generation(ex)
    assert samsum.max_new_tokens == 128 and samsum.stop_strings == ["\n"]
    assert task_from_config("longbench", subset="lcc").generation(ex).max_new_tokens == 64
    assert task_from_config("longbench", subset="lcc", max_new_tokens=16).generation(ex).max_new_tokens == 16
    assert task_from_config("longbench", subset="gov_report").generation(ex).stop_strings == []
    qa = task_from_config("longbench", subset="hotpotqa").make_example(longbench_row(4, answers=["Bob", "Ann 4"]), 0)
    assert task_from_config("longbench", subset="hotpotqa").score("Ann 4", qa)[LongBench.primary_metric] == 1.0


def test_every_subset_is_configured() -> None:
    assert yaml.safe_load((ROOT / "configs" / "task" / "longbench.yaml").read_text())["subset"] in SUBSETS
    no_chat = {s for s, spec in SUBSETS.items() if not spec.chat}
    assert no_chat == {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    assert {s for s, spec in SUBSETS.items() if spec.first_line} == {"trec", "triviaqa", "samsum", "lsht"}
    assert all(
        "{input}" in spec.tail
        for s, spec in SUBSETS.items()
        if s not in {"gov_report", "multi_news", "vcsum", "passage_count", "lcc"}
    )
