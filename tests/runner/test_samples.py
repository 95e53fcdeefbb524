"""sampling.n_samples: seeded samples made one row per example, with pass@1 and pass@k computed here from the
row's own samples; lengths beside the full cache's. Checked against the engine run directly, one request per
seed, and against reruns and batches."""

from __future__ import annotations

import pytest
from conftest import CONFIG_DIR
from hydra import compose, initialize_config_dir

from kvbench.config import validate
from kvbench.engine import batch
from kvbench.engine.engine import Engine, EngineSettings, Request
from kvbench.results.writer import read_rows
from kvbench.runner import model_cache
from kvbench.runner.cell import run_cell
from kvbench.runner.prompts import render_all
from kvbench.stages import Stage
from kvbench.tasks.registry import build_task

TINY = ["model=tiny-llama", "task.n=3", "task.context_tokens=96", "task.max_new_tokens=5"]
SAMPLED = ["sampling.do_sample=true", "sampling.temperature=1.5"]


@pytest.fixture
def uneven_lengths(monkeypatch):
    """Every third token id ends a sequence, so that sampled generations stop at different lengths (the random
    tiny model rarely picks its one end token)."""
    monkeypatch.setattr(batch, "eos_ids", lambda model, tokenizer: set(range(0, 1000, 3)))


def cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def rows_of(tmp_path, name: str, overrides: list[str]) -> list[dict]:
    run_cell(cfg(TINY + [f"results_dir={tmp_path}"] + overrides), tmp_path / name, "t")
    return read_rows(tmp_path / name / "rows.jsonl")


def engine_texts(overrides: list[str], seed: int) -> dict[str, tuple[str, int]]:
    """Each example's text and length from the engine alone, one request at a time, seeded ``seed``."""
    spec = validate(cfg(TINY + overrides))
    task = build_task(spec.task_cfg)
    examples = task.examples()
    rendered = render_all(task, examples, spec)
    lm = model_cache.get_model(spec.model)
    engine = Engine(lm.model, lm.tokenizer, EngineSettings(spec.policy, spec.budget, Stage(spec.stage)))
    out = {}
    for ex in examples:
        settings = spec.decode_settings(task.generation(ex).max_new_tokens, [])
        settings.seed = seed
        g = engine.run([Request(rendered[ex.id].input_ids, rendered[ex.id].suffix_ids, settings)])[0]
        out[ex.id] = (task.postprocess(g.text, ex), g.measures.new_tokens)
    return out


def test_each_sample_is_the_engine_run_seeded_seed_plus_its_index(tmp_path, uneven_lengths):
    policy = ["policy=window", "budget=0.5", "stage=decode"]
    rows = rows_of(tmp_path, "k3", policy + SAMPLED + ["sampling.n_samples=3", "seed=7"])
    for j in range(3):
        alone = engine_texts(policy + SAMPLED, seed=7 + j)
        for r in rows:
            assert (r["sample_predictions"][j], r["sample_new_tokens"][j]) == alone[r["example_id"]]
    assert any(len(set(r["sample_predictions"])) > 1 for r in rows), "seeded apart, samples must differ"
    assert len({n for r in rows for n in r["sample_new_tokens"]}) > 1
    for r in rows:  # the row's own columns are sample 0's
        assert r["prediction"] == r["sample_predictions"][0] and r["new_tokens"] == r["sample_new_tokens"][0]
        assert r["n_samples"] == 3 and r["new_tokens_mean"] == pytest.approx(sum(r["sample_new_tokens"]) / 3)


def test_one_sample_is_todays_row(tmp_path):
    """n_samples=1 (the default) runs the engine once per example, as before: greedy, and sampled at the seed."""
    for name, extra in [("greedy", []), ("sampled", SAMPLED + ["seed=3"])]:
        rows = rows_of(tmp_path, name, ["policy=window", "budget=0.5"] + extra)
        alone = engine_texts(["policy=window", "budget=0.5"] + extra, seed=3)
        for r in rows:
            assert (r["prediction"], r["new_tokens"]) == alone[r["example_id"]]
            assert r["n_samples"] == 1 and r["sample_predictions"] is None and r["new_tokens_mean"] == r["new_tokens"]
            assert not any(k.startswith("metric.pass@") for k in r)


def test_pass_at_k_and_score_from_the_samples(tmp_path, monkeypatch):
    """Samples scored 1, 0, 1 (by a stand-in metric) give pass@1 = 2/3, pass@3 = 1, score = 2/3; 0, 0, 0 give 0."""
    from kvbench.tasks.retrieval import RetrievalTask

    verdicts = iter([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    monkeypatch.setattr(RetrievalTask, "score", lambda self, p, ex: {"accuracy": next(verdicts), "other": 0.5})
    rows = rows_of(tmp_path, "k3", ["policy=window", "budget=0.5"] + SAMPLED + ["sampling.n_samples=3"])
    got = [(r["sample_scores"], r["score"], r["metric.pass@1"], r["metric.pass@k"], r["metric.other"]) for r in rows]
    assert got == [
        ([1.0, 0.0, 1.0], pytest.approx(2 / 3), pytest.approx(2 / 3), 1.0, 0.5),
        ([0.0, 0.0, 0.0], 0.0, 0.0, 0.0, 0.5),
        ([0.0, 0.0, 1.0], pytest.approx(1 / 3), pytest.approx(1 / 3), 1.0, 0.5),
    ]


def test_reruns_and_batches_give_the_same_samples(tmp_path, uneven_lengths):
    k2 = ["policy=window", "budget=0.5", "stage=decode", *SAMPLED, "sampling.n_samples=2"]
    first = rows_of(tmp_path, "a", k2)
    again = rows_of(tmp_path, "b", k2)
    batched = rows_of(tmp_path, "c", k2 + ["batch_size=3"])
    texts = [[(r["sample_predictions"], r["sample_new_tokens"]) for r in rows] for rows in (first, again, batched)]
    assert texts[0] == texts[1] == texts[2]
    assert len({n for r in first for n in r["sample_new_tokens"]}) > 1, "sequences leave the batch at different steps"


@pytest.mark.slow
def test_lengths_beside_the_full_caches(tmp_path, monkeypatch):
    """full_new_tokens is what the full cache generated for the same prompt and seeds (its own cell's new_tokens),
    not the run's own length; kept_of_full = budget_tokens / (prompt_tokens + full_new_tokens); without a
    reference both are empty. SmolLM2, so that eviction changes what is generated; some token ids end a sequence,
    so that the change shows in the lengths."""
    monkeypatch.setattr(batch, "eos_ids", lambda model, tokenizer: set(range(5, 50000, 13)))
    base = ["model=smollm2-135m", "task.max_new_tokens=16", "stage=decode", *SAMPLED, "sampling.temperature=0.7"]
    k2 = [*base, "sampling.n_samples=2"]
    bare = rows_of(tmp_path / "fresh", "bare", ["policy=random", "budget=0.2"] + k2)
    assert all(r["full_new_tokens"] is None and r["kept_of_full"] is None for r in bare)
    full = {r["example_id"]: r for r in rows_of(tmp_path, "full", ["policy=full"] + k2)}
    rows = rows_of(tmp_path, "random", ["policy=random", "budget=0.2", "fidelity=true"] + k2)
    for r in rows:
        mine = full[r["example_id"]]
        assert r["sample_full_new_tokens"] == mine["sample_new_tokens"]
        assert r["full_new_tokens"] == pytest.approx(sum(mine["sample_new_tokens"]) / 2)
        assert r["kept_of_full"] == pytest.approx(r["budget_tokens"] / (r["prompt_tokens"] + r["full_new_tokens"]))
    assert any(r["sample_new_tokens"] != r["sample_full_new_tokens"] for r in rows), "eviction must change a length"
