"""LongBench v1 metrics, re-implemented to give the same per-example values as THUDM/LongBench.

Every function takes ``(prediction, ground_truth, all_classes=None)`` and returns a float in
[0, 1]; :func:`best_over_references` applies LongBench's rule (the best score over the reference
answers). LongBench reports 100 x the mean of those per-example scores.

Two reference implementations are not dependencies here, so their behaviour is reproduced:

* ``rouge_score`` is ROUGE-L F of the ``rouge`` PyPI package (1.0.1): text split into sentences
  at ``.``, words at single spaces, and the summary-level union-LCS counted over word *types*.
  One deliberate difference: that package traces the LCS back recursively, so a sentence pair
  whose traceback is longer than Python's recursion limit (~1000 words together; mostly Chinese
  text, which has no ``.``) raises there and LongBench scores the example 0; here it is computed.
* ``code_sim_score`` uses fuzzywuzzy 0.18's ``fuzz.ratio`` as installed by LongBench's
  requirements (no python-Levenshtein): difflib's ratio rounded to an integer percent.
  ``rapidfuzz.fuzz.ratio`` is *not* the same number (it is an LCS/Indel ratio and is often a few
  points higher), so it is not used.
"""

from __future__ import annotations

import difflib
import logging
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from functools import lru_cache
from types import ModuleType

from kvbench.metrics.registry import metric_function, register_metric

Metric = Callable[..., float]

# Punctuation LongBench strips from Chinese answers, on top of ASCII punctuation.
_ZH_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～"  # full-width forms
    "｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿"  # CJK brackets and marks
    "–—‘’‛“”„‟…‧﹏."  # dashes, curly quotes, ellipsis
)
_EN_PUNCT = frozenset(string.punctuation)
_ZH_PUNCT = frozenset(string.punctuation + _ZH_PUNCTUATION)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


@lru_cache(maxsize=1)
def _jieba() -> ModuleType:
    import jieba

    jieba.setLogLevel(logging.WARNING)  # its dictionary build logs at DEBUG on first use
    return jieba


def _cut(text: str) -> list[str]:
    return list(_jieba().cut(text, cut_all=False))


# ---------------------------------------------------------------- token F1


def normalize_en(text: str) -> str:
    """Lower-case, drop ASCII punctuation, then the articles a/an/the, then collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_zh(text: str) -> str:
    """Lower-case, drop Chinese and ASCII punctuation, and remove all whitespace."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ZH_PUNCT).split())


def token_f1(prediction: Sequence[str], reference: Sequence[str]) -> float:
    """F1 of the multiset overlap of two token lists."""
    same = sum((Counter(prediction) & Counter(reference)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


@metric_function(higher_is_better=True, label="QA F1")
def qa_f1_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    return token_f1(normalize_en(prediction).split(), normalize_en(ground_truth).split())


@metric_function(higher_is_better=True, label="QA F1 (zh)")
def qa_f1_zh_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    def tokens(text: str) -> list[str]:
        return [t for t in (normalize_zh(w) for w in _cut(text)) if t]

    return token_f1(tokens(prediction), tokens(ground_truth))


# ---------------------------------------------------------------- ROUGE-L of the `rouge` package


def _sentences(text: str) -> list[list[str]]:
    """Pieces between '.'s (empty ones dropped), whitespace collapsed, then split at single spaces."""
    return [" ".join(piece.split()).split(" ") for piece in text.split(".") if piece]


def _lcs_words(ref: list[str], hyp: list[str]) -> set[str]:
    """Words of one LCS of ``ref`` and ``hyp``, traced back with the `rouge` package's tie-breaking."""
    table = [[0] * (len(hyp) + 1) for _ in range(len(ref) + 1)]
    for i, word in enumerate(ref, 1):
        row, above = table[i], table[i - 1]
        for j, other in enumerate(hyp, 1):
            row[j] = above[j - 1] + 1 if word == other else max(above[j], row[j - 1])
    words: set[str] = set()
    i, j = len(ref), len(hyp)
    while i and j:
        if ref[i - 1] == hyp[j - 1]:
            words.add(ref[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_l_f(prediction: str, reference: str) -> float:
    """Summary-level ROUGE-L F as ``Rouge().get_scores(p, r)[0]['rouge-l']['f']`` computes it.

    The union LCS and both lengths count distinct words, which is what that package does.
    Raises ``ValueError`` when either text has no sentence (empty or only dots), as it does.
    """
    hyp, ref = _sentences(prediction), _sentences(reference)
    if not hyp or not ref:
        raise ValueError("ROUGE-L needs at least one sentence on each side")
    union: set[str] = set()
    for ref_sentence in ref:
        for hyp_sentence in hyp:
            union |= _lcs_words(ref_sentence, hyp_sentence)
    recall = len(union) / len({w for s in ref for w in s})
    precision = len(union) / len({w for s in hyp for w in s})
    return 2.0 * (precision * recall) / (precision + recall + 1e-8)


@metric_function(higher_is_better=True, label="ROUGE-L (LongBench)")
def rouge_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """ROUGE-L F; 0 where the `rouge` package raises (an empty prediction, for example)."""
    try:
        return rouge_l_f(prediction, ground_truth)
    except ValueError:
        return 0.0


@metric_function(higher_is_better=True, label="ROUGE-L (LongBench, zh)")
def rouge_zh_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """ROUGE-L F over jieba words (joined by spaces so that the word split above sees them)."""
    return rouge_score(" ".join(_cut(prediction)), " ".join(_cut(ground_truth)))


# ---------------------------------------------------------------- classification, counting, retrieval


@metric_function(higher_is_better=True, label="classification accuracy")
def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """1/k when the ground truth is among the k class names found in the prediction, else 0.

    Found names that are proper substrings of the ground truth are dropped first, with LongBench's
    quirk kept: it removes them from the list it is iterating over, so a name right after a dropped
    one is not examined.
    """
    if not all_classes:
        raise ValueError("classification_score needs all_classes")
    found = [name for name in all_classes if name in prediction]
    i = 0
    while i < len(found):
        if found[i] in ground_truth and found[i] != ground_truth:
            found.remove(found[i])
        i += 1
    return 1.0 / len(found) if ground_truth in found else 0.0


def _fraction_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(number == target for number in numbers) / len(numbers) if numbers else 0.0


@metric_function(higher_is_better=True, label="count accuracy")
def count_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """Share of the numbers in the prediction that equal the count."""
    return _fraction_equal(prediction, str(ground_truth))


@metric_function(higher_is_better=True, label="retrieval accuracy")
def retrieval_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """Share of the numbers in the prediction that equal N of the ground truth's 'Paragraph N'."""
    return _fraction_equal(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


@metric_function(higher_is_better=True, label="retrieval accuracy (zh)")
def retrieval_zh_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """As :func:`retrieval_score`, for the Chinese '段落N'."""
    return _fraction_equal(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


# ---------------------------------------------------------------- code


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy 0.18 ``fuzz.ratio`` on its pure-Python path: 100 if equal, 0 if one is empty."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


@metric_function(higher_is_better=True, label="code similarity")
def code_sim_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """Similarity of the first generated line that is not a comment or a code fence."""
    lines = prediction.lstrip("\n").split("\n")
    line = next((ln for ln in lines if "`" not in ln and "#" not in ln and "//" not in ln), "")
    return fuzz_ratio(line, ground_truth) / 100


# ---------------------------------------------------------------- task level

METRICS: dict[str, Metric] = {
    f.__name__: f
    for f in (
        qa_f1_score,
        qa_f1_zh_score,
        rouge_score,
        rouge_zh_score,
        classification_score,
        retrieval_score,
        retrieval_zh_score,
        count_score,
        code_sim_score,
    )
}

# A LongBench row's primary metric: its subset's own metric above (every one of them higher-is-better).
register_metric("score", higher_is_better=True, label="score")


def first_line(text: str) -> str:
    """LongBench's cut for trec, triviaqa, samsum and lsht: leading newlines off, then line one."""
    return text.lstrip("\n").split("\n")[0]


def best_over_references(
    metric: Metric, prediction: str, references: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """The best score against any reference answer (0 with none), as LongBench's eval does."""
    return max((metric(prediction, ref, all_classes=all_classes) for ref in references), default=0.0)
