"""ROUGE and LongBench metrics against values worked out by hand on short strings."""

from __future__ import annotations

import pytest

from kvbench.metrics import longbench as lb
from kvbench.metrics.rouge import rouge_l, rouge_scores

# ---------------------------------------------------------------- rouge_score-based ROUGE


def test_rouge_hand_computed() -> None:
    # pred: the cat sat on the mat   ref: the cat lay on the mat   (6 tokens each)
    # unigrams shared: the x2, cat, on, mat = 5            -> P = R = F = 5/6
    # bigrams: the-cat, on-the, the-mat shared of 5 each   -> F = 3/5
    # LCS: the cat on the mat = 5                          -> rougeL = rougeLsum = 5/6
    s = rouge_scores("the cat sat on the mat", "the cat lay on the mat")
    assert s["rouge1"] == pytest.approx(5 / 6)
    assert s["rouge2"] == pytest.approx(3 / 5)
    assert s["rougeL"] == pytest.approx(5 / 6)
    assert s["rougeLsum"] == pytest.approx(5 / 6)
    assert rouge_l("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)


def test_rouge_stems_and_splits_sentences_on_newlines() -> None:
    # Porter stemming (words over 3 letters): cats -> cat, running/runs -> run: all unigrams match.
    assert rouge_scores("Cats running", "cat runs")["rouge1"] == pytest.approx(1.0)
    # rougeL on "a b c d" vs "c d a b": LCS 2 of 4 -> 0.5. rougeLsum unions the LCS per reference
    # line: "c d" finds {c, d}, "a b" finds {a, b}: 4 of 4 -> 1.0.
    s = rouge_scores("a b\nc d", "c d\na b")
    assert s["rougeL"] == pytest.approx(0.5)
    assert s["rougeLsum"] == pytest.approx(1.0)


def test_rouge_best_reference() -> None:
    # Against "the cat" alone rouge1 is 1.0; against "a dog" it is 0: the best one counts.
    assert rouge_scores("the cat", ["a dog", "the cat"])["rouge1"] == pytest.approx(1.0)
    assert all(0.0 <= v <= 1.0 for v in rouge_scores("x y z", "z y x w").values())
    with pytest.raises(ValueError):
        rouge_scores("x", [])


# ---------------------------------------------------------------- LongBench: QA F1


def test_qa_f1_english_normalisation() -> None:
    # "The Eiffel Tower, in Paris!" -> lower, no punctuation, no article -> eiffel tower in paris
    # shared with "eiffel tower": 2 -> P = 2/4, R = 2/2 -> F = 2*0.5*1/1.5 = 2/3
    assert lb.qa_f1_score("The Eiffel Tower, in Paris!", "Eiffel tower") == pytest.approx(2 / 3)
    # Articles go only as whole words: "anna" stays, "an" and "the" go -> {anna} vs {anna}.
    assert lb.qa_f1_score("An Anna the", "anna") == pytest.approx(1.0)
    assert lb.qa_f1_score("nothing shared", "else") == 0.0
    assert lb.normalize_en("  A  b.C  ") == "bc"


def test_qa_f1_chinese_with_jieba() -> None:
    # jieba: 北京大学。-> [北京大学, 。]; the full stop normalises away -> [北京大学] vs [北京大学] -> 1
    assert lb.qa_f1_zh_score("北京大学。", "北京大学") == pytest.approx(1.0)
    # 我爱北京 -> [我, 爱, 北京] vs [北京]: 1 shared -> P = 1/3, R = 1 -> F = 2*(1/3)/(4/3) = 1/2
    assert lb.qa_f1_zh_score("我爱北京", "北京") == pytest.approx(0.5)
    assert lb.normalize_zh("（答案：A b）") == "答案ab"


# ---------------------------------------------------------------- LongBench: ROUGE-L of the `rouge` package


def test_longbench_rouge_l_hand_computed() -> None:
    # Sentences split at '.': hyp = [the cat sat | the dog ran], ref = [the cat ran].
    # Distinct words: ref {the, cat, ran} = 3, hyp {the, cat, sat, dog, ran} = 5.
    # LCS(ref, hyp1) words {the, cat}; LCS(ref, hyp2) words {the, ran}; union 3.
    # R = 3/3, P = 3/5 -> F = 2*0.6*1/(1.6 + 1e-8) = 0.75
    assert lb.rouge_score("the cat sat. the dog ran", "the cat ran") == pytest.approx(0.75)
    # Repeats count once: hyp {a}, ref {a, b}; union {a} -> R = 1/2, P = 1 -> F = 2/3.
    assert lb.rouge_score("a a a", "a b") == pytest.approx(2 / 3)
    # The package raises on a text with no sentence; LongBench then scores 0.
    assert lb.rouge_score("", "a b") == 0.0
    assert lb.rouge_score("...", "a b") == 0.0
    with pytest.raises(ValueError):
        lb.rouge_l_f("", "a b")


def test_longbench_rouge_zh() -> None:
    # jieba: 我爱北京天安门 -> 我 爱 北京 天安门 (4 words); 我爱北京 -> 我 爱 北京 (3 words).
    # LCS 3 -> R = 3/4, P = 1 -> F = 2*0.75/1.75 = 6/7
    assert lb.rouge_zh_score("我爱北京", "我爱北京天安门") == pytest.approx(6 / 7)


# ---------------------------------------------------------------- LongBench: classification, counting, retrieval


def test_classification_score() -> None:
    classes = ["New York", "York", "Boston"]
    # Found: New York, York; York is a proper substring of the truth and is dropped -> 1/1.
    assert lb.classification_score("New York or York", "New York", all_classes=classes) == 1.0
    # Found: York, Boston -> the truth "York" among 2 -> 1/2.
    assert lb.classification_score("York? Boston?", "York", all_classes=classes) == 0.5
    assert lb.classification_score("Boston", "York", all_classes=classes) == 0.0
    # LongBench's quirk: found [ab, a, b, c]; dropping "a" shifts "b" into the slot just examined,
    # so "b" survives -> [ab, b, c] -> 1/3 (the rule as stated would give [ab, c] -> 1/2).
    assert lb.classification_score("ab c", "ab", all_classes=["ab", "a", "b", "c"]) == pytest.approx(1 / 3)


def test_count_and_retrieval_scores() -> None:
    # numbers in the prediction: 5, 12 -> one of two equals 5
    assert lb.count_score("There are 5 unique paragraphs out of 12", "5") == 0.5
    assert lb.count_score("none", "5") == 0.0
    assert lb.retrieval_score("Paragraph 12, not 3", "Paragraph 12") == 0.5
    assert lb.retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert lb.retrieval_score("no idea", "Paragraph 12") == 0.0
    # numbers: 2, 27 -> 1/2
    assert lb.retrieval_zh_score("答案是段落2和段落27", "段落27") == 0.5


def test_code_sim_score() -> None:
    # The fence and the comment line are skipped; "x = foo(1)" vs "x = foo(2)": difflib matches
    # "x = foo(" and ")" = 9 of 10 + 10 chars -> 2*9/20 = 0.90
    assert lb.code_sim_score("```python\n# comment\nx = foo(1)\ny", "x = foo(2)") == pytest.approx(0.9)
    # difflib is greedy: its first longest block is 'a' (a[0] = b[2]), after which nothing on either
    # side matches: 2*1/12 -> 17. An LCS ratio (rapidfuzz) would give 2*2/12 -> 33.
    assert lb.fuzz_ratio("abcabc", "cbazyx") == 17
    assert lb.code_sim_score("abcabc", "cbazyx") == pytest.approx(0.17)
    assert lb.code_sim_score("# only a comment", "x = 1") == 0.0
    assert lb.fuzz_ratio("", "") == 100


def test_best_over_references_and_first_line() -> None:
    assert lb.best_over_references(lb.qa_f1_score, "paris", ["london", "Paris"]) == 1.0
    assert lb.best_over_references(lb.qa_f1_score, "paris", []) == 0.0
    assert lb.first_line("\n\nIndividual\nQuestion: more") == "Individual"
    assert set(lb.METRICS) == {
        "qa_f1_score",
        "qa_f1_zh_score",
        "rouge_score",
        "rouge_zh_score",
        "classification_score",
        "retrieval_score",
        "retrieval_zh_score",
        "count_score",
        "code_sim_score",
    }
