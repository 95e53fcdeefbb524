"""When a policy evicts (the run's ``Stage``) and what a forward feeds (a step's ``Phase``), defined once for the
config, the engine and the policy parts. Kept free of every other kvbench import, so that any layer may use it."""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """An enum whose members are their strings (``Stage.prefill == "prefill"``, formatted as ``prefill``), as
    ``enum.StrEnum`` is from Python 3.11 on."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Phase(Choice):
    """What a step feeds: prompt tokens (a chunk of the context, or the suffix) or one generated token per
    sequence."""

    prefill = "prefill"
    decode = "decode"


class Stage(Choice):
    """Where the budget applies: compressing the prompt, while generating, or both."""

    prefill = "prefill"
    decode = "decode"
    both = "both"

    def evicts_in(self, phase: Phase) -> bool:
        """Whether a step of ``phase`` evicts down to the budget in this stage."""
        return self is Stage.both or self.value == phase.value
