"""Choosing the next token and when to stop: greedy or seeded sampling, the model's end tokens, stop strings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DecodeSettings:
    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop_strings: list[str] = field(default_factory=list)


def choose_token(logits: torch.Tensor, settings: DecodeSettings, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy, or temperature + nucleus sampling from a seeded generator."""
    if not settings.do_sample:
        return logits.argmax(dim=-1)
    scaled = logits.float() / max(settings.temperature, 1e-6)
    probs = scaled.softmax(dim=-1)
    if settings.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs > settings.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def hit_stop(tokenizer: Any, tokens: list[int], stops: list[str]) -> bool:
    text = tokenizer.decode(tokens[-16:], skip_special_tokens=True)
    return any(s in text for s in stops)


def cut_at_stop(text: str, stops: list[str]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=len(text))
    return text[:cut]
