"""task=lm_eval: lm-eval's tasks in kvbench's cells, scored as lm-eval's own ``hf`` model scores them.

The reference is lm-eval itself: ``lm_eval.simple_evaluate(model="hf", ...)`` on the same docs with greedy decoding,
its logged samples' per-doc metrics against the rows of a ``policy=full`` cell. The tasks are two YAMLs of the
test's own over local JSONL files (a multiple-choice one, answered by log-likelihoods, and a generated one), and
RULER's ``niah_single_1``, which lm-eval generates with the model's tokenizer (slow: lm-eval builds 500 docs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONFIG_DIR
from hydra import compose, initialize_config_dir

from kvbench.config import ConfigError, validate
from kvbench.embedded import embedded_checkpoint
from kvbench.results.writer import CellResults, read_rows
from kvbench.runner import model_cache
from kvbench.runner.cell import run_cell
from kvbench.tasks.lm_eval.harness import MEAN, MEAN_OF_DEFINED, aggregation_kind, load_docs
from kvbench.tasks.registry import build_task

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

MC = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Rome"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["three", "four", "five"], "answer": 1},
    {"question": "The colour of the sky on a clear day is", "choices": ["green", "red", "blue"], "answer": 2},
]
QA = [
    {"question": "What is the capital of France?", "answer": "Paris"},
    {"question": "What is two plus two?", "answer": "4"},
    {"question": "What colour is the sky?", "answer": "blue"},
]
MC_YAML = """task: local_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
"""
QA_YAML = """task: local_qa
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: generate_until
doc_to_text: "Question: What is the capital of Italy?\\nAnswer: Rome\\n\\nQuestion: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 12, do_sample: false}}
filter_list:
  - name: first-word
    filter: [{{function: regex, regex_pattern: "(\\\\w+)"}}, {{function: take_first}}]
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true, ignore_case: true}}
"""
SAMPLED_YAML = QA_YAML.replace("local_qa", "local_sampled").replace("do_sample: false", "do_sample: true")
BLEU_YAML = QA_YAML.replace("local_qa", "local_bleu").replace(
    "{{metric: exact_match, aggregation: mean, higher_is_better: true, ignore_case: true}}",
    "{{metric: bleu, aggregation: bleu, higher_is_better: true}}",
)


@pytest.fixture
def include(tmp_path: Path) -> Path:
    """A folder of the test's task YAMLs, their data beside them."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    yamls = {"mc": (MC, MC_YAML), "qa": (QA, QA_YAML), "bleu": (QA, BLEU_YAML), "sampled": (QA, SAMPLED_YAML)}
    for name, (rows, template) in yamls.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (folder / f"{name}.yaml").write_text(template.format(data=data))
    return folder


def overrides(include: Path, task: str, *extra: str, model: str = "smollm2-135m") -> list[str]:
    return [f"model={model}", "task=lm_eval", f"task.tasks=[{task}]", f"task.include_path={include}", *extra]


def cell(tmp_path: Path, name: str, args: list[str]) -> list[dict]:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=args)
    run_cell(cfg, tmp_path / name, "t")
    rows = read_rows(tmp_path / name / "rows.jsonl")
    assert rows and all(r["status"] == "ok" for r in rows), rows
    return rows


def spec_task(args: list[str]) -> tuple[dict, dict]:
    """The task config and model config a cell of ``args`` builds its task from."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        spec = validate(compose("config", overrides=args))
    return spec.task_cfg, spec.model


def lm_eval_samples(task: str, include: Path | None, limit: int, metadata: dict | None = None) -> list[dict]:
    """lm-eval's own run of SmolLM2 (its ``hf`` model, float32, greedy): the logged samples, in doc order."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    path = embedded_checkpoint()
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={path},dtype=float32",
        tasks=[task],
        # lm-eval's own tasks get the model's arguments as metadata (RULER reads its tokenizer there) when lm-eval
        # builds the task manager itself
        task_manager=TaskManager(include_path=str(include)) if include else None,
        metadata=metadata,
        limit=limit,
        log_samples=True,
        device="cpu",
        batch_size=1,
    )
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


def metrics_of(row: dict) -> dict[str, float]:
    return {k.removeprefix("metric."): v for k, v in row.items() if k.startswith("metric.")}


@pytest.mark.parametrize("task", ["local_mc", "local_qa"])
def test_full_cache_scores_each_doc_as_lm_eval_hf_does(tmp_path, include, task):
    rows = cell(tmp_path, "full", overrides(include, task, "task.limit=3", "policy=full"))
    samples = lm_eval_samples(task, include, 3)
    assert [r["example_id"] for r in rows] == [f"{task}/{s['doc_id']}" for s in samples]
    suffix = "" if task == "local_mc" else ",first-word"  # the QA task's filter, in lm-eval's name of its metric
    for row, sample in zip(rows, samples):
        assert metrics_of(row) == {name + suffix: sample[name] for name in sample["metrics"]}
        if task == "local_qa":
            assert row["prediction"] == sample["resps"][0][0]  # the text before lm-eval's filter
    primary = "acc" if task == "local_mc" else "exact_match,first-word"
    assert rows[0]["primary_metric"] == primary
    assert {r["score"] for r in rows} == {0.0, 1.0}  # the docs are told apart: some answers right, some wrong


@pytest.mark.parametrize("task", ["local_mc", "local_qa"])
def test_an_evicting_policy_at_the_whole_length_is_the_full_cache(tmp_path, include, task):
    full = cell(tmp_path, "full", overrides(include, task, "task.limit=3", "policy=full"))
    kept = cell(tmp_path, "all", overrides(include, task, "task.limit=3", "policy=snapkv", "budget=1.0"))
    small = cell(tmp_path, "small", overrides(include, task, "task.limit=3", "policy=window", "budget=2"))
    assert [metrics_of(r) for r in kept] == [metrics_of(r) for r in full]
    assert [r.get("prediction") for r in kept] == [r.get("prediction") for r in full]
    for s, f in zip(small, full):
        assert s["kv_resident_bytes"] < f["kv_resident_bytes"], (s["kv_resident_bytes"], f["kv_resident_bytes"])


def test_a_killed_cell_resumes_without_losing_or_repeating_a_doc(tmp_path, include, monkeypatch, tiny):
    monkeypatch.setattr(model_cache, "get_model", lambda *_: tiny)
    args = overrides(include, "local_mc", "policy=window", "budget=0.5", model="tiny-llama")
    append = CellResults.append
    written: list[str] = []

    def killed_after_one(self, row):
        if written:
            raise KeyboardInterrupt  # the process dies between two docs
        append(self, row)
        written.append(row.example_id)

    monkeypatch.setattr(CellResults, "append", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        cell(tmp_path, "c", args)
    assert [r["example_id"] for r in read_rows(tmp_path / "c" / "rows.jsonl")] == ["local_mc/0"]
    monkeypatch.setattr(CellResults, "append", append)
    rows = cell(tmp_path, "c", args)
    assert [r["example_id"] for r in rows] == ["local_mc/0", "local_mc/1", "local_mc/2"]


def test_bad_input_is_refused_before_any_model_loads(tmp_path, include, monkeypatch):
    monkeypatch.setattr(model_cache, "get_model", lambda *_: pytest.fail("a model loaded"))

    def refusal(args: list[str]) -> str:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("config", overrides=args)
        with pytest.raises(ConfigError) as err:
            validate(cfg)
        return str(err.value)

    assert "lm-eval has no task 'no_such_task'" in refusal(overrides(include, "no_such_task", model="tiny-llama"))
    assert "aggregated by bleu, not a mean over docs" in refusal(overrides(include, "local_bleu", model="tiny-llama"))
    assert "give it greedy settings" in refusal(overrides(include, "local_sampled", model="tiny-llama"))
    mixed = overrides(include, "local_mc,local_qa", model="tiny-llama")
    assert "run them as separate cells" in refusal(mixed)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # lm-eval not installed
    assert "pip install 'kvbench[lm-eval]'" in refusal(overrides(include, "local_mc", model="tiny-llama"))


def test_kvbench_imports_every_task_without_lm_eval():
    """Without lm-eval, the registry still imports every task module (lm-eval is imported when a cell asks)."""
    code = "import sys; sys.modules['lm_eval'] = None; from kvbench.tasks.registry import TASKS; print(TASKS.names())"
    env = {**os.environ, "PYTHONPATH": str(CONFIG_DIR.parent)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "'lm_eval'" in out and "'retrieval'" in out


def test_only_a_mean_over_docs_is_carried_by_rows():
    """lm-eval's own aggregations: a mean, RULER's mean over the docs that have a length, and ones a row per doc
    cannot carry (corpus BLEU, F1 over all docs, the median)."""
    from lm_eval.api.metrics import bleu, f1_score, mean, median
    from lm_eval.tasks.ruler.common_utils import aggregate_metrics

    kinds = [aggregation_kind(f) for f in (mean, aggregate_metrics, bleu, f1_score, median, max)]
    assert kinds == [MEAN, MEAN_OF_DEFINED, None, None, None, None]


@pytest.mark.slow
def test_ruler_niah_full_cache_scores_as_lm_eval_hf(tmp_path):
    """RULER's needle at 1024 tokens, generated by lm-eval with SmolLM2's tokenizer on both sides."""
    args = [
        "model=smollm2-135m",
        "task=lm_eval",
        "task.tasks=[niah_single_1]",
        "task.limit=2",
        "task.metadata={max_seq_lengths:[1024]}",
        "policy=full",
    ]
    rows = cell(tmp_path, "full", args)
    samples = lm_eval_samples("niah_single_1", None, 2, {"max_seq_lengths": [1024]})
    assert [r["example_id"] for r in rows] == [f"niah_single_1/{s['doc_id']}" for s in samples]
    for row, sample in zip(rows, samples):
        expected = {name: sample[name] for name in sample["metrics"] if sample[name] != -1}
        assert metrics_of(row) == expected == {"1024": expected["1024"]}
        assert row["prediction"] == sample["resps"][0][0]
    # Another process draws the same docs (a resumed cell finds its own): the cached load forgotten, drawn again.
    first = [ex.prompt for ex in build_task(*spec_task(args)).examples()]
    load_docs.cache_clear()
    assert [ex.prompt for ex in build_task(*spec_task(args)).examples()] == first
