"""``kvbench-profile mode=retrieval_heads`` on the tiny model: the saved scores are a NumPy count of copies on the
model's own eager attention over the prompt and the answer in one forward, and ``headkv`` reads them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import CONFIG_DIR
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvbench.config import ConfigError
from kvbench.families import policy_problem
from kvbench.models import load_model
from kvbench.policies.registry import build_policy
from kvbench.profile import app
from kvbench.tasks.prompting import encode
from kvbench.tasks.registry import build_task

TINY = ("mode=retrieval_heads", "model=tiny-llama", "task=retrieval", "task.n=2", "task.context_tokens=96")


def profile_config(*overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("profile", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)


def numpy_copies(model, prompt: list[int], answer: list[int]) -> np.ndarray:
    """[layers, KV heads]: one eager forward over prompt + answer; per query head, the share of answer tokens whose
    predicting query looks most at a needle position (an occurrence of the answer's tokens) holding that token."""
    n, m = len(prompt), len(answer)
    needle = np.zeros(n, dtype=bool)
    for start in range(n - m + 1):
        if prompt[start : start + m] == answer:
            needle[start : start + m] = True
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(torch.tensor([prompt + answer]), output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)
    kv = model.config.num_key_value_heads
    out = []
    for attention in attentions:
        rows = attention[0, :, n - 1 : n - 1 + m].double().numpy()  # [heads, m, n + m]
        share = np.zeros(rows.shape[0])
        for head in range(rows.shape[0]):
            for i in range(m):
                j = int(rows[head, i].argmax())
                share[head] += j < n and needle[j] and prompt[j] == answer[i]
        out.append((share / m).reshape(kv, -1).mean(axis=1))
    return np.stack(out)


def test_saved_scores_are_the_copies_of_one_eager_forward(tmp_path, one_thread):
    cfg = profile_config(*TINY)
    path = app.profile_heads(cfg, tmp_path)
    data = json.loads(path.read_text())
    lm = load_model("tiny-llama", source="tiny", dtype="float32", device="cpu")
    config = lm.model.config
    assert (data["layers"], data["kv_heads"], data["examples"]) == (
        config.num_hidden_layers,
        config.num_key_value_heads,
        2,
    )
    task = build_task(dict(cfg["task"]))
    expected = []
    for example in task.examples():
        rendered = task.render(example, lm.tokenizer)
        prompt = list(rendered.input_ids) + list(rendered.suffix_ids)
        expected.append(numpy_copies(lm.model, prompt, encode(lm.tokenizer, example.references[0])))
    np.testing.assert_allclose(np.array(data["scores"]), np.mean(expected, axis=0), atol=1e-12)
    headkv = OmegaConf.load(CONFIG_DIR / "policy" / "profiled" / "headkv.yaml")
    headkv.allocation.scores = str(path)
    assert policy_problem(config, build_policy(OmegaConf.to_container(headkv, resolve=True))) is None
    assert np.ptp(expected) > 0  # some heads copy, some do not: the comparison can fail


def test_a_task_whose_answers_are_not_in_its_prompts_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "The sky is blue.", "reference": "91827"}) + "\n")
    monkeypatch.setattr(app, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    cfg = profile_config("mode=retrieval_heads", "model=tiny-llama", "task=jsonl", f"task.path={data}")
    with pytest.raises(ConfigError, match=r"example a: its answer \['91827'\] does not occur in its prompt"):
        app.profile_heads(cfg, tmp_path)


def test_a_bad_mode_is_refused():
    with pytest.raises(ConfigError, match="mode='bogus' must be one of"):
        app.check_mode("bogus")
