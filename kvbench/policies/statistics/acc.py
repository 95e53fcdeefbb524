"""H2O's accumulated attention."""

from kvbench.policies.statistics.declared import Summed, declare

declare(Summed("acc", "attention probability received, summed over every query that saw it"))
