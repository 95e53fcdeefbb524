"""One generator per kind of RULER subtask: a seeded example at a given haystack size.

A generator draws what is asked and answered from ``Random(seed)`` alone, so an example's references do not
depend on the length it is rendered at, and the haystack's layout (needle depths, shuffles) from
``Random(seed/size)``, so the same seed and size always give the same text. ``size`` counts the haystack's units
(noise lines, essay words, distractor needles, list words, coded words, characters of distractor documents);
``kvbench.tasks.ruler.fit`` picks the largest that fits the asked length.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass, field
from random import Random

from kvbench.tasks.ruler import templates as t
from kvbench.tasks.ruler.haystacks import NOISE, random_value, sentences, word_list
from kvbench.tasks.ruler.qa import QaPool

DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's 40 needle depths, percent of the haystack


@dataclass
class Sample:
    """A prompt in its parts: ``head + body + tail`` is compressed, then ``question``, then ``answer_prefix`` starts
    the answer. ``needles`` and ``depths`` (percent) say what the body hides where (NIAH)."""

    head: str
    body: str
    tail: str
    question: str
    answer_prefix: str
    references: list[str]
    needles: list[str] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    # NIAH: each asked key alone, as (question, answer prefix, references) — ``task.ask=each``.
    each: list[tuple[str, str, list[str]]] = field(default_factory=list)

    @property
    def context(self) -> str:
        return self.head + self.body + self.tail


def layout(seed: str, size: int) -> Random:
    return Random(f"{seed}/layout/{size}")


# ---------------------------------------------------------------- needle in a haystack


def niah(spec: t.Subtask, seed: str, size: int, essay: list[str] | None) -> Sample:
    """``n_keys`` keys with ``n_values`` values each, one needle per value, at depths drawn from RULER's 40;
    ``n_queries`` of the keys asked. ``size``: noise copies, essay words or distractor needles."""
    content = Random(seed)
    keys: list[str] = []
    while len(keys) < spec.n_keys:
        key = random_value(content, spec.key_kind)
        keys += [key] if key not in keys else []
    values = [[random_value(content, spec.value_kind) for _ in range(spec.n_values)] for _ in keys]
    needles = [
        t.NIAH_NEEDLE.format(kind=spec.value_kind, key=key, value=value)
        for key, key_values in zip(keys, values)
        for value in key_values
    ]
    asked = sorted(content.sample(range(spec.n_keys), spec.n_queries))
    query = _listing([keys[i] for i in asked])
    single = spec.n_queries * spec.n_values == 1
    head, question, prefix = t.niah_wording(spec.value_kind, query, single)

    rng = layout(seed, size)
    rng.shuffle(needles)
    depths = sorted(rng.sample(DEPTHS, len(needles)))
    units, joiner = _haystack_units(spec, rng, size, essay, set(keys))
    for offset, (needle, depth) in enumerate(zip(needles, depths)):
        units.insert(int((len(units) - offset) * depth / 100) + offset, needle)
    references = [value for i in asked for value in values[i]]
    each = [(*t.niah_wording(spec.value_kind, keys[i], spec.n_values == 1)[1:], values[i]) for i in asked]
    return Sample(head, joiner.join(units), "\n", question, prefix, references, needles, depths, each)


def _haystack_units(
    spec: t.Subtask, rng: Random, size: int, essay: list[str] | None, keys: set[str]
) -> tuple[list[str], str]:
    if spec.haystack == "repeat":
        return [NOISE] * size, "\n"
    if spec.haystack == "essay":
        assert essay is not None  # loaded by the task
        return sentences(" ".join(essay[:size])), " "
    distractors: list[str] = []
    while len(distractors) < size:  # needles of other keys, never one of the hidden keys
        key = random_value(rng, spec.key_kind)
        if key not in keys:
            value = random_value(rng, spec.value_kind)
            distractors.append(t.NIAH_NEEDLE.format(kind=spec.value_kind, key=key, value=value))
    return distractors, "\n"


def _listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


# ---------------------------------------------------------------- variable tracking

VT_HOPS = 4  # RULER's vt: one chain of four hops, five variables
VT_EXAMPLE_NOISE = 10  # noise lines of the worked example before the task


def vt(seed: str, size: int) -> Sample:
    """A value assigned to one variable and passed along four more, among ``size`` noise lines, after one worked
    example (three-letter names) as RULER's prompt has."""
    content = Random(seed)
    example_body, example_names, example_value = _chain(content, 3, Random(f"{seed}/example"), VT_EXAMPLE_NOISE)
    body, names, value = _chain(content, 5, layout(seed, size), size)
    example = (
        t.VT_HEAD
        + example_body
        + "\n"
        + t.VT_QUESTION.format(value=example_value)
        + t.VT_PREFIX.format(count=len(example_names), value=example_value)
        + " ".join(example_names)
    )
    question = t.VT_QUESTION.format(value=value)
    prefix = t.VT_PREFIX.format(count=len(names), value=value)
    return Sample(example + "\n\n" + t.VT_HEAD, body, "\n", question, prefix, names)


def _chain(content: Random, letters: int, rng: Random, noise: int) -> tuple[str, list[str], str]:
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        name = "".join(content.choices(string.ascii_uppercase, k=letters))
        names += [name] if name not in names else []
    value = str(content.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]
    lines = [NOISE] * noise
    spots = sorted(rng.sample(range(noise + 1), len(chain)))
    for offset, (spot, line) in enumerate(zip(spots, chain)):
        lines.insert(spot + offset, line)  # each assignment after the one it copies
    return "\n".join(lines), names, value


# ---------------------------------------------------------------- common words

CWE_COMMON = 10


def cwe_frequencies(context_tokens: int) -> tuple[int, int, int, int, int]:
    """RULER's (common, uncommon) repeats, and the worked example's (words, common, uncommon repeats): smaller
    below 4096 tokens."""
    return (6, 1, 20, 3, 1) if context_tokens < 4096 else (30, 3, 40, 10, 3)


def cwe(seed: str, size: int, context_tokens: int) -> Sample:
    """A numbered list of 10 common words repeated often and ``size`` uncommon ones repeated rarely, after a worked
    example; the answer is the common words."""
    freq_common, freq_rare, example_words, example_common, example_rare = cwe_frequencies(context_tokens)
    content = Random(seed)
    words = word_list("noun", "adjective", "verb")
    order = content.sample(words, len(words))
    shown = order[:example_words]
    example_list = shown[:CWE_COMMON] * example_common + shown[CWE_COMMON:] * example_rare
    content.shuffle(example_list)
    common = order[example_words : example_words + CWE_COMMON]
    rare = order[example_words + CWE_COMMON : example_words + CWE_COMMON + size]
    listed = common * freq_common + rare * freq_rare
    layout(seed, size).shuffle(listed)
    example = t.CWE_HEAD + _numbered(example_list) + "\n" + t.CWE_QUESTION + t.CWE_PREFIX + " " + _numbered(shown[:10])
    return Sample(example + "\n" + t.CWE_HEAD, _numbered(listed), "\n", t.CWE_QUESTION, t.CWE_PREFIX, common)


def cwe_most(context_tokens: int) -> int:
    return len(word_list("noun", "adjective", "verb")) - CWE_COMMON - cwe_frequencies(context_tokens)[2]


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i}. {word}" for i, word in enumerate(words, 1))


# ---------------------------------------------------------------- frequent words

FWE_ALPHA = 2.0  # RULER's Zipf exponent; zeta(2) = pi^2 / 6
FWE_WORD_LETTERS = 6
FWE_LEAST = 100  # below this many words the third answer may tie with the fourth


def fwe_counts(size: int, vocabulary: int) -> list[int]:
    """RULER's counts: the word of rank k appears int(size * k^-alpha / zeta(alpha)) times."""
    zeta = math.pi**2 / 6
    return [int(size * k**-FWE_ALPHA / zeta) for k in range(1, vocabulary + 1)]


def fwe(seed: str, size: int, context_tokens: int) -> Sample:
    """Coded words with Zipf counts from ``size`` draws; the most frequent is RULER's noise '...', the next three
    are the answer."""
    content = Random(seed)
    vocabulary: list[str] = []
    while len(vocabulary) < max(context_tokens // 50, 5):  # RULER's vocabulary: one word per 50 tokens
        word = "".join(content.choices(string.ascii_lowercase, k=FWE_WORD_LETTERS))
        vocabulary += [word] if word not in vocabulary else []
    vocabulary[0] = "..."
    words = [w for w, count in zip(vocabulary, fwe_counts(size, len(vocabulary))) for _ in range(count)]
    layout(seed, size).shuffle(words)
    return Sample(t.FWE_HEAD, " ".join(words), "\n", t.FWE_QUESTION, t.FWE_PREFIX, vocabulary[1:4])


# ---------------------------------------------------------------- question answering


def qa_candidates(seed: str, pool: QaPool, item: int) -> list[int]:
    """The distractors in the order they are taken: the question's related documents, then the rest, each shuffled."""
    content = Random(seed)
    own = pool.items[item]
    related = list(own.related)
    content.shuffle(related)
    taken = set(own.gold) | set(related)
    rest = [i for i in range(len(pool.documents)) if i not in taken]
    content.shuffle(rest)
    return related + rest


def qa(seed: str, size: int, pool: QaPool, item: int, candidates: list[int]) -> Sample:
    """The question's gold documents and distractors (in ``candidates`` order, skipping any that would pass
    ``size`` characters), shuffled and numbered."""
    own = pool.items[item]
    chosen = list(own.gold)
    left = size
    for i in candidates:
        length = len(pool.documents[i])
        if length <= left:
            chosen.append(i)
            left -= length
        if left < 100:
            break
    layout(seed, size).shuffle(chosen)
    body = "\n\n".join(t.QA_DOCUMENT.format(number=n, text=pool.documents[i]) for n, i in enumerate(chosen, 1))
    return Sample(t.QA_HEAD, body, "\n\n", t.QA_QUESTION.format(question=own.question), t.QA_PREFIX, own.answers)
