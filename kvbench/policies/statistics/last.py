"""TOVA's most recent attention."""

from kvbench.policies.statistics.declared import Latest, declare

declare(Latest("last", "the attention probability from the most recent query"))
