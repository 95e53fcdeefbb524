"""One Hydra cell end to end: rows with measured numbers, resume, jsonl prompts, early refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import CONFIG_DIR, REPO
from hydra import compose, initialize_config_dir

from kvbench.config import ConfigError
from kvbench.results.writer import read_rows
from kvbench.runner import example, model_cache
from kvbench.runner.cell import run_cell
from kvbench.runner.paths import cell_path

TINY = ["model=tiny-llama", "task.n=3", "task.context_tokens=160", "task.max_new_tokens=4"]


def cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def test_cell_writes_measured_rows_and_summary(tmp_path):
    cell = tmp_path / "cell"
    summary = run_cell(cfg(TINY + ["policy=streamingllm", "budget=0.5"]), cell, "t")
    rows = read_rows(cell / "rows.jsonl")
    assert [r["example_id"] for r in rows] == ["passkey-0", "passkey-1", "passkey-2"]
    for r in rows:
        assert r["status"] == "ok" and r["policy"] == "streamingllm" and r["budget"] == 0.5
        assert 0.45 < r["budget_achieved"] <= 0.5 + 1 / r["prompt_tokens"]
        assert r["prefill_s"] > 0 and r["ttft_s"] >= r["prefill_s"] and r["decode_tokens_per_s"] > 0
        assert 0 < r["kv_resident_bytes"] <= r["kv_capacity_bytes"] and r["peak_memory_bytes"] > 0
        assert r["git_sha"] and r["versions"]["torch"] and r["dtype"] == "float32" and r["device"]
    assert summary["n_ok"] == 3 and json.loads((cell / "summary.json").read_text())["n_ok"] == 3
    assert (cell / "config.yaml").read_text().count("streamingllm") >= 1


def test_a_quest_cell_keeps_its_budget_and_says_it_holds_everything(tmp_path):
    """Quest evicts nothing, but its budget decides what it attends: the cell and its rows keep the budget asked
    for (the full cache's would read 1.0), and the rows say every token was held."""
    summary = run_cell(cfg(TINY + ["policy=quest", "stage=decode", "budget=0.25"]), tmp_path / "cell", "t")
    rows = read_rows(tmp_path / "cell" / "rows.jsonl")
    assert summary["budget"] == 0.25 and summary["n_ok"] == 3
    for r in rows:
        assert r["budget"] == 0.25 and r["budget_tokens"] == -(-(r["prompt_tokens"] + 4) // 4)
        assert r["budget_achieved"] == 1.0 and r["kept_tokens"] == r["seen_tokens"]
        assert 0 < r["kv_resident_bytes"] <= r["kv_capacity_bytes"]


def test_rerun_skips_finished_examples(tmp_path, monkeypatch):
    cell = tmp_path / "cell"
    config = cfg(TINY + ["policy=window", "budget=0.5"])
    run_cell(config, cell, "t")
    rows_before = (cell / "rows.jsonl").read_text()
    # Simulate a crash after two examples: drop the summary and the last row.
    (cell / "summary.json").unlink()
    (cell / "rows.jsonl").write_text("".join(rows_before.splitlines(keepends=True)[:2]))
    calls = []
    real = example.generation_outcome
    monkeypatch.setattr(example, "generation_outcome", lambda *a, **k: calls.append(a[3].id) or real(*a, **k))
    run_cell(config, cell, "t")
    assert calls == ["passkey-2"]
    assert [r["example_id"] for r in read_rows(cell / "rows.jsonl")] == ["passkey-0", "passkey-1", "passkey-2"]
    # A complete cell is skipped without touching the model.
    monkeypatch.setattr(model_cache, "get_model", lambda *_: pytest.fail("a finished cell loaded the model"))
    run_cell(config, cell, "t")


def test_failing_example_becomes_error_row(tmp_path, monkeypatch):
    real = example.generation_outcome

    def boom(lm, task, spec, ex, *rest):
        if ex.id == "passkey-1":
            raise RuntimeError("synthetic failure")
        return real(lm, task, spec, ex, *rest)

    monkeypatch.setattr(example, "generation_outcome", boom)
    run_cell(cfg(TINY + ["policy=window"]), tmp_path / "c", "t")
    rows = read_rows(tmp_path / "c" / "rows.jsonl")
    assert [r["status"] for r in rows] == ["ok", "error", "ok"]
    assert "synthetic failure" in rows[1]["error"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["budget=0"], "budget=0 must be at least 1 token"),
        (["budget=1.5"], "budget=1.5 is out of range"),
        (["budget=-0.2"], "budget=-0.2 is out of range"),
        (["stride=0"], "stride=0 must be a positive integer"),
        (["task=jsonl", "task.path=/nonexistent/prompts.jsonl"], "task.path=/nonexistent/prompts.jsonl does not exist"),
        (["stage=sideways"], "stage='sideways' is unknown"),
    ],
)
def test_bad_input_is_refused_before_the_model_loads(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setattr(model_cache, "get_model", lambda *_: pytest.fail("the model loaded before validation"))
    base = ["model=tiny-llama"] if "task=jsonl" in overrides else TINY
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        run_cell(cfg(base + overrides), tmp_path / "c", "t")


@pytest.mark.parametrize(
    "override, message",
    [
        ("policy=nope", "Could not find 'policy/nope'"),
        ("model=nope", "Could not find 'model/nope'"),
        ("task=nope", "Could not find 'task/nope'"),
        ("budget=1.5", "budget=1.5 is out of range"),
    ],
)
def test_cli_prints_one_clear_message(tmp_path, override, message):
    model = [] if override.startswith("model=") else ["model=tiny-llama"]
    out = subprocess.run(
        [sys.executable, "-m", "kvbench.run", override, *model, f"results_dir={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode != 0
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_jsonl_prompts_match_model_generate_on_smollm2(tmp_path, smollm):
    prompts = ["The three primary colours are", "def fibonacci(n):", "Paris is the capital of"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    config = cfg(
        [
            "task=jsonl",
            f"task.path={path}",
            "task.chat_template=false",
            "task.max_new_tokens=12",
            "policy=full",
            "model.dtype=float32",
            "model.device=cpu",
        ]
    )
    run_cell(config, tmp_path / "cell", "t")
    rows = read_rows(tmp_path / "cell" / "rows.jsonl")
    tok = smollm.tokenizer
    for prompt, row in zip(prompts, rows):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        out = smollm.model.generate(ids, max_new_tokens=12, do_sample=False)
        assert row["prediction"] == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert row["status"] == "ok"


def test_retrieval_renders_the_requested_length_and_hides_the_needle(tiny):
    from kvbench.tasks.retrieval import RetrievalTask

    task = RetrievalTask(n=3, context_tokens=400, depths=[0.0, 0.5, 1.0], chat_template=False)
    for ex in task.examples():
        prompt = task.render(ex, tiny.tokenizer)
        text = tiny.tokenizer.decode(prompt.input_ids)
        assert 340 <= len(prompt.input_ids) <= 400
        assert ex.references[0] in text
        start, end = text.index("\n\n") + 2, text.rindex("\n\n")  # the filler body
        where = (text.index(ex.references[0]) - start) / (end - start)
        assert abs(where - ex.meta["depth"]) < 0.25  # the needle itself is a fifth of this short body
    assert task.score("The passkey is 12345.", ex.__class__(id="x", prompt="", references=["12345"])) == {
        "accuracy": 1.0,
        "exact_match": 0.0,
    }
    assert task.score("12345", ex.__class__(id="x", prompt="", references=["12345"]))["exact_match"] == 1.0
    assert task.score("1234", ex.__class__(id="x", prompt="", references=["12345"]))["accuracy"] == 0.0


def test_a_batched_cell_scores_every_example_as_batch_one(tmp_path):
    """batch_size=3 over 5 examples (slots refilled, then the batch shrinks): the same predictions and scores as
    one at a time; each row says it was batched and what the batch did."""
    base = [
        "model=tiny-llama",
        "task.n=5",
        "task.context_tokens=160",
        "task.max_new_tokens=6",
        "policy=h2o",
        "budget=0.5",
        "stage=both",
    ]
    run_cell(cfg(base), tmp_path / "one", "t")
    run_cell(cfg(base + ["batch_size=3"]), tmp_path / "three", "t")
    alone = {r["example_id"]: r for r in read_rows(tmp_path / "one" / "rows.jsonl")}
    batched = read_rows(tmp_path / "three" / "rows.jsonl")
    assert sorted(r["example_id"] for r in batched) == sorted(alone)
    for r in batched:
        a = alone[r["example_id"]]
        assert r["status"] == "ok" and r["prediction"] == a["prediction"] and r["score"] == a["score"]
        assert r["budget_achieved"] == a["budget_achieved"] and r["kv_resident_bytes"] == a["kv_resident_bytes"]
        assert r["batch_size"] == 3 and a["batch_size"] == 1
        assert r["batch_decode_tokens_per_s"] >= r["decode_tokens_per_s"] * 0.999
    assert max(r["decode_batch_mean"] for r in batched) > 1.5
    named = {"model": {"name": "m"}, "task": {"name": "t"}, "policy": {"name": "h2o"}, "stage": "both", "budget": 0.5}
    assert cell_path({**named, "batch_size": 3}, {}).endswith("budget=0.5/batch=3")
    assert cell_path({**named, "batch_size": 1}, {}).endswith("budget=0.5")


def test_batch_size_must_be_a_positive_integer(tmp_path):
    for bad in ("0", "-2", "1.5", "true"):
        with pytest.raises(ConfigError, match="batch_size=.* must be a positive integer"):
            run_cell(cfg(TINY + [f"batch_size={bad}"]), tmp_path / "c", "t")
