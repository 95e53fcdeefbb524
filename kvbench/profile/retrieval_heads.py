"""Retrieval-head scores, HeadKV's per-head importance (Fu et al. 2024, arXiv:2410.19258), measured on a needle task
and saved for ``allocation=headkv``: ``kvbench-profile mode=retrieval_heads task=retrieval``.

Per example, the model reads the prompt and then the reference answer, teacher-forced. At each answer token the
query that predicts it attends the prompt; a query head *copies* that token when its highest attention lands on a
position of the needle holding that very token (the needle: where the answer's tokens occur in the prompt). A query
head's score is the share of the answer's tokens it copies, averaged over the examples; a KV head's is its GQA
group's mean. Written as ``retrieval_heads.json``: the model's name, its layer and KV head counts (what
``headkv`` checks a run's model against) and the scores [layers][KV heads]."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from kvbench.tasks.prompting import encode

FILE = "retrieval_heads.json"


def needle_positions(prompt: list[int], answer: list[int]) -> np.ndarray:
    """Bool [n]: the positions of every occurrence of ``answer``'s token sequence in ``prompt``."""
    n, m = len(prompt), len(answer)
    out = np.zeros(n, dtype=bool)
    for start in range(n - m + 1):
        if prompt[start : start + m] == answer:
            out[start : start + m] = True
    return out


def answer_attention(model: Any, prompt: list[int], answer: list[int]) -> list[torch.Tensor]:
    """Per layer, the attention [query heads, m, n + m - 1] of the queries that predict the answer's ``m`` tokens
    (the prompt's last token and the answer's first m - 1), teacher-forced: eager attention for those queries only."""
    cache = DynamicCache()
    previous = model.config._attn_implementation
    with torch.no_grad():
        if len(prompt) > 1:
            model(torch.tensor([prompt[:-1]], device=model.device), past_key_values=cache)
        model.set_attn_implementation("eager")
        try:
            fed = torch.tensor([prompt[-1:] + answer[:-1]], device=model.device)
            out = model(fed, past_key_values=cache, output_attentions=True)
        finally:
            model.set_attn_implementation(previous)
    return [a[0].float().cpu() for a in out.attentions]


def copy_scores(attentions: list[torch.Tensor], prompt: list[int], answer: list[int], kv_heads: int) -> np.ndarray:
    """[layers, KV heads]: per KV head, the mean over its query heads of the share of answer tokens copied."""
    needle = needle_positions(prompt, answer)
    tokens = np.array(prompt)
    wanted = np.array(answer)
    out = []
    n = len(prompt)
    for attention in attentions:
        top = attention.argmax(dim=-1).numpy()  # [query heads, m]: where each looks most
        inside = top < n  # the answer's own tokens are no needle
        at = np.where(inside, top, 0)
        copied = inside & needle[at] & (tokens[at] == wanted[None, :])
        out.append(copied.mean(axis=1).reshape(kv_heads, -1).mean(axis=1))
    return np.stack(out)


def needles(task: Any, tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """Each example's prompt (context and suffix) and answer, in token ids, read with the tokenizer alone. An
    example whose answer does not occur in its prompt as the same tokens is refused: it has no needle to copy."""
    out = []
    for example in task.examples():
        rendered = task.render(example, tokenizer)
        prompt = list(rendered.input_ids) + list(rendered.suffix_ids)
        answer = encode(tokenizer, example.references[0]) if example.references else []
        if not answer or not needle_positions(prompt, answer).any():
            raise ValueError(
                f"example {example.id}: its answer {example.references[:1]} does not occur in its prompt as the same "
                "tokens, so no head can copy it; use a needle task (task=retrieval)"
            )
        out.append((prompt, answer))
    return out


def measure(model: Any, examples: list[tuple[list[int], list[int]]]) -> np.ndarray:
    """Mean scores over the examples (``needles``), [layers, KV heads]."""
    kv_heads = model.config.get_text_config().num_key_value_heads
    scores = [copy_scores(answer_attention(model, p, a), p, a, kv_heads) for p, a in examples]
    return np.mean(scores, axis=0)


def write(scores: np.ndarray, model_name: str, task_name: str, examples: int, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / FILE
    data = {
        "kind": "retrieval_heads",
        "model": model_name,
        "task": task_name,
        "examples": examples,
        "layers": int(scores.shape[0]),
        "kv_heads": int(scores.shape[1]),
        "scores": scores.tolist(),
    }
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path
