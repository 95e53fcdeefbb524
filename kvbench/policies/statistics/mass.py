"""The attention mass merged into an entry (``merge: true``)."""

from kvbench.policies.statistics.declared import Merged, declare

declare(Merged("mass", "attention weight of the entries merged into this one"))
