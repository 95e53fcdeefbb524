"""Each RULER subtask's definition as RULER's synthetic config sets it: which generator, its haystack and needles,
the prompt's wording (context part, question part, answer prefix) and the tokens the answer may take.

The wording is RULER's, since the benchmark's scores are defined with it; the question part is what
``question_aware=false`` feeds after the compressed context, the answer prefix starts the model's turn.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Subtask:
    kind: str  # niah | vt | cwe | fwe | qa
    max_new_tokens: int
    metric: str  # string_match_all | string_match_part
    haystack: str = ""  # niah: repeat | essay | needle
    key_kind: str = "words"  # niah: what a needle's key is (words | numbers | uuids)
    value_kind: str = "numbers"  # niah: what a needle's value is
    n_keys: int = 1  # niah: keys hidden
    n_values: int = 1  # niah: values per key
    n_queries: int = 1  # niah: keys asked for
    dataset: str = ""  # qa: squad | hotpotqa


def _niah(
    haystack: str, key: str = "words", value: str = "numbers", keys: int = 1, values: int = 1, queries: int = 1
) -> Subtask:
    return Subtask("niah", 128, "string_match_all", haystack, key, value, keys, values, queries)


SUBTASKS: dict[str, Subtask] = {
    "niah_single_1": _niah("repeat"),
    "niah_single_2": _niah("essay"),
    "niah_single_3": _niah("essay", value="uuids"),
    "niah_multikey_1": _niah("essay", keys=4),
    "niah_multikey_2": _niah("needle"),
    "niah_multikey_3": _niah("needle", key="uuids", value="uuids"),
    "niah_multivalue": _niah("essay", values=4),
    "niah_multiquery": _niah("essay", keys=4, queries=4),
    "vt": Subtask("vt", 30, "string_match_all"),
    "cwe": Subtask("cwe", 120, "string_match_all"),
    "fwe": Subtask("fwe", 50, "string_match_all"),
    "qa_1": Subtask("qa", 32, "string_match_part", dataset="squad"),
    "qa_2": Subtask("qa", 32, "string_match_part", dataset="hotpotqa"),
}

# ---------------------------------------------------------------- needle in a haystack

NIAH_NEEDLE = "One of the special magic {kind} for {key} is: {value}."


def niah_wording(value_kind: str, query: str, single: bool) -> tuple[str, str, str]:
    """(head before the context, question, answer prefix); one value asked of one key reads in the singular."""
    kinds = value_kind[:-1] if single else value_kind
    some, be = ("A", "is") if single else ("Some", "are")
    head = (
        f"{some} special magic {kinds} {be} hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the {kinds} afterwards.\n"
    )
    asked = "What is the" if single else "What are all the"
    question = f"{asked} special magic {kinds} for {query} mentioned in the provided text?"
    prefix = f" The special magic {kinds} for {query} mentioned in the provided text {be}"
    return head, question, prefix


# ---------------------------------------------------------------- variable tracking

VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
# RULER's prefix, its misspelling included: the answer prefix is part of the benchmark's prompt.
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {count} variables are assgined "
    "the value {value}, they are: "
)

# ---------------------------------------------------------------- common and frequent words

CWE_HEAD = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"

FWE_HEAD = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. "
)
FWE_QUESTION = (
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

# ---------------------------------------------------------------- question answering

QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)
QA_HEAD = f"{QA_INSTRUCTION}\n\nThe following are given documents.\n\n"
QA_QUESTION = f"{QA_INSTRUCTION}\n\nQuestion: {{question}}"
QA_DOCUMENT = "Document {number}:\n{text}"
QA_PREFIX = " Answer:"
