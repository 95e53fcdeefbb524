"""kvbench as an lm-eval model against lm-eval's own ``hf`` model on the same weights: with the full cache (and
with an evicting policy at a budget of the whole prompt) the same generations, metric values and
log-likelihoods; at a small budget, lower scores and the resident KV bytes the budget says."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from lm_eval_runs import FIXTURES, SEQ_LENGTH, evaluate, kvbench_lm, measures, samples

LL_TOL = 1e-4  # nats: a prefill plus one-token decode steps against one forward over the whole text
NIAH = "niah_single_1"
pytestmark = pytest.mark.real_model


def assert_same_generations(ours: dict[str, Any], reference: dict[str, Any], task: str) -> None:
    mine, theirs = samples(ours, task), samples(reference, task)
    assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in theirs]
    for a, b in zip(mine, theirs):
        assert a["resps"] == b["resps"], f"doc {a['doc_id']}"
        assert a["filtered_resps"] == b["filtered_resps"]
    assert ours["results"][task] == reference["results"][task]


def assert_same_loglikelihoods(ours: dict[str, Any], reference: dict[str, Any], task: str) -> None:
    mine, theirs = samples(ours, task), samples(reference, task)
    assert len(mine) == len(theirs) > 0
    for a, b in zip(mine, theirs):
        for resp_a, resp_b in zip(a["resps"], b["resps"], strict=True):
            got, want = resp_a[0], resp_b[0]
            if isinstance(want, tuple | list):  # loglikelihood: (logprob, is_greedy)
                assert got[0] == pytest.approx(want[0], abs=LL_TOL)
                assert got[1] == want[1]
            else:  # loglikelihood_rolling: the text's logprob
                assert got == pytest.approx(want, abs=LL_TOL)


@pytest.fixture(scope="module")
def smollm_dir() -> str:
    """The embedded SmolLM2's converted checkpoint: what lm-eval's hf model and RULER's tokenizer load."""
    from kvbench.embedded import embedded_checkpoint

    return str(embedded_checkpoint(None, "smollm2"))


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory: pytest.TempPathFactory, smollm_dir: str) -> Any:
    """lm-eval's tasks plus the fact tasks, their data file given by absolute path; RULER sized by SmolLM2's
    tokenizer."""
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    for name in ("facts.yaml", "facts_rolling.yaml"):
        config = yaml.safe_load((FIXTURES / name).read_text())
        config["dataset_kwargs"]["data_files"]["test"] = str(FIXTURES / "facts.jsonl")
        (folder / name).write_text(yaml.safe_dump(config))
    return TaskManager(include_path=str(folder), metadata={"tokenizer": smollm_dir, "max_seq_lengths": [SEQ_LENGTH]})


@pytest.fixture(scope="module")
def hf_lm(smollm_dir: str) -> Any:
    """lm-eval's own model on the same weights: the reference."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=smollm_dir, dtype="float32", device="cpu", batch_size=1)


@pytest.fixture(scope="module")
def reference(hf_lm: Any, task_manager: Any) -> dict[str, Any]:
    return evaluate(hf_lm, [NIAH, "kvbench_facts", "kvbench_facts_rolling"], task_manager, limit=1)


@pytest.mark.parametrize(
    "model_args",
    [{"policy": "full"}, {"policy": "snapkv", "budget": 1.0}, {"policy": "h2o", "budget": 1.0, "stage": "decode"}],
    ids=["full", "snapkv-whole-prompt", "h2o-decode-whole"],
)
def test_same_answers_as_lm_evals_hf_model(
    model_args: dict[str, Any], reference: dict[str, Any], task_manager: Any
) -> None:
    ours = evaluate(kvbench_lm(**model_args), [NIAH, "kvbench_facts", "kvbench_facts_rolling"], task_manager, 1)
    assert_same_generations(ours, reference, NIAH)
    assert_same_loglikelihoods(ours, reference, "kvbench_facts")
    assert_same_loglikelihoods(ours, reference, "kvbench_facts_rolling")
    assert ours["results"]["kvbench_facts"]["acc,none"] == reference["results"]["kvbench_facts"]["acc,none"]


def test_a_small_budget_scores_lower_and_holds_what_it_says(reference: dict[str, Any], task_manager: Any) -> None:
    lm = kvbench_lm(policy="snapkv", budget=0.25, stage="prefill")
    ours = evaluate(lm, [NIAH], task_manager, limit=1)
    score = f"{SEQ_LENGTH},none"
    assert reference["results"][NIAH][score] == 1.0  # the full cache finds the needle
    assert ours["results"][NIAH][score] < reference["results"][NIAH][score]
    config = lm.lm.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    bytes_per_token = config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * 4  # K and V, float32
    (sample,) = samples(ours, NIAH)
    (m,) = measures(sample)
    prompt = m["prompt_tokens"]
    assert m["budget_tokens"] == round(0.25 * prompt)
    assert m["budget_achieved"] == pytest.approx(m["budget_tokens"] / prompt)
    # the compressed prompt, then every generated token but the last (never fed) appended in decode
    assert m["kv_resident_bytes"] == (m["budget_tokens"] + m["new_tokens"] - 1) * bytes_per_token
    assert m["timings"]["prefill_s"] > 0


RULER_LONGER = ["ruler_vt", "ruler_cwe", "ruler_fwe"]  # their generators need more than 512 tokens to build docs
LONGER = 1024


@pytest.mark.slow
def test_ruler_vt_cwe_fwe_give_lm_evals_answers_with_the_full_cache(hf_lm: Any, smollm_dir: str) -> None:
    """lm-eval's other offline RULER tasks, at 1,024 tokens: kvbench's full cache gives the hf model's generations
    and scores on the same docs (built once: ruler_cwe draws other words at each build)."""
    from lm_eval.evaluator import evaluate as run_tasks
    from lm_eval.tasks import TaskManager, get_task_dict

    tasks = get_task_dict(RULER_LONGER, TaskManager(metadata={"tokenizer": smollm_dir, "max_seq_lengths": [LONGER]}))
    reference = run_tasks(hf_lm, tasks, limit=1, log_samples=True, bootstrap_iters=0)
    ours = run_tasks(kvbench_lm(policy="full"), tasks, limit=1, log_samples=True, bootstrap_iters=0)
    for task in RULER_LONGER:
        assert_same_generations(ours, reference, task)
