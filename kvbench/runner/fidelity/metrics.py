"""The measures of fidelity to the full cache: text overlap, next-token agreement, divergence.

The full cache's next-token distributions are stored compactly, as each step's top-``K`` tokens
with their log-probabilities plus the log-probability of "any other token" (:func:`summarize_logits`).

``kl_divergence`` is the mean over steps ``t`` of ``KL(P_t || Q_t)`` in nats, where ``P_t`` is the
full cache's next-token distribution and ``Q_t`` the compressed run's, both *coarsened* to ``K + 1``
outcomes: the full cache's top-``K`` tokens at step ``t``, each on its own, and one bucket holding
every other token. When ``K`` covers the vocabulary this is exactly the KL of the softmax
distributions; otherwise it is a lower bound of it (merging outcomes never increases KL) that is
tight when the full cache puts little mass outside its top ``K`` (``topk_mass`` reports that mass).
Identical logits give exactly 0: both sides go through the same float32 ``log_softmax``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass
class LogitSummary:
    """Per step: ``ids`` [T, K] (descending probability), ``logprobs`` [T, K], ``rest`` [T] (log mass of the rest)."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    rest: torch.Tensor

    @property
    def steps(self) -> int:
        return int(self.ids.shape[0])


def _rest_logprob(logprobs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log of the probability mass outside ``ids`` per row, as a logsumexp (no 1 - sum cancellation)."""
    if ids.shape[-1] >= logprobs.shape[-1]:
        return torch.full(logprobs.shape[:-1], float("-inf"), dtype=logprobs.dtype)
    masked = logprobs.scatter(-1, ids, float("-inf"))
    return masked.logsumexp(-1)


def summarize_logits(logits: torch.Tensor, k: int) -> LogitSummary:
    """The top-``k`` of each row of ``logits`` [T, V] as log-probabilities, plus the rest's log mass."""
    logprobs = logits.float().cpu().log_softmax(-1)
    k = min(k, logprobs.shape[-1])
    top = logprobs.topk(k, dim=-1)  # sorted: ids[:, 0] is the argmax
    return LogitSummary(ids=top.indices, logprobs=top.values, rest=_rest_logprob(logprobs, top.indices))


def _xlogx_ratio(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """p * (log p - log q), with 0 where p = 0 (and where both are 0)."""
    p = log_p.exp()
    term = p * (log_p - log_q)
    return torch.where(p > 0, term, torch.zeros_like(term))


def kl_per_step(reference: LogitSummary, logits: torch.Tensor) -> torch.Tensor:
    """KL(P_t || Q_t) over the coarsened outcomes (see the module docstring), nats, float64 [T]."""
    if logits.shape[0] != reference.steps:
        raise ValueError(f"{logits.shape[0]} steps of logits against a reference of {reference.steps}")
    q = logits.float().cpu().log_softmax(-1)
    ids = reference.ids.long()
    q_top = q.gather(-1, ids).double()
    q_rest = _rest_logprob(q, ids).double()
    p_top = reference.logprobs.double()
    p_rest = reference.rest.double()
    return _xlogx_ratio(p_top, q_top).sum(-1) + _xlogx_ratio(p_rest, q_rest)


def kl_divergence(reference: LogitSummary, logits: torch.Tensor) -> float:
    """Mean over steps of the coarsened KL(P_full || Q_compressed), nats."""
    return float(kl_per_step(reference, logits).mean())


def top1_agreement(logits: torch.Tensor, tokens: list[int] | torch.Tensor) -> float:
    """Fraction of steps whose argmax equals the given token (the full cache's token at that step)."""
    target = torch.as_tensor(tokens, dtype=torch.long)
    if logits.shape[0] != target.shape[0]:
        raise ValueError(f"{logits.shape[0]} steps of logits against {target.shape[0]} tokens")
    return float((logits.argmax(-1).cpu() == target).double().mean())


def topk_mass(reference: LogitSummary) -> float:
    """Mean probability the full cache puts on its stored top-K tokens (1 = the KL is exact)."""
    return float(reference.logprobs.double().exp().sum(-1).mean())


def token_nll(logits: torch.Tensor, targets: list[int] | torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood (nats, float64) of each target under its row of ``logits`` [T, V]."""
    target = torch.as_tensor(targets, dtype=torch.long).unsqueeze(-1)
    return -logits.float().cpu().log_softmax(-1).gather(-1, target).squeeze(-1).double()


# ---------------------------------------------------------------- text overlap

# Scripts without spaces between words: every character is its own token (as ROUGE-zh does via jieba
# words, coarser); rouge_score's own tokenizer would drop these characters and score such text 0.
_CJK = re.compile(r"([\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff])")


class _Tokenizer:
    """rouge_score's default tokenizer (lower-case, [a-z0-9] words, Porter stemming) plus CJK characters."""

    def __init__(self) -> None:
        from rouge_score import tokenizers

        self.default = tokenizers.DefaultTokenizer(use_stemmer=True)

    def tokenize(self, text: str) -> list[str]:
        out: list[str] = []
        for i, piece in enumerate(_CJK.split(text)):
            if i % 2:
                out.append(piece)
            elif piece:
                out.extend(self.default.tokenize(piece))
        return out


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], tokenizer=_Tokenizer())


def fidelity_rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F of a prediction against the full cache's prediction; identical texts score exactly 1."""
    if prediction == reference:
        return 1.0
    return float(_scorer().score(reference, prediction)["rougeL"].fmeasure)
