"""KVzip's reconstruction attention: what the replay passes' queries give each entry of the prompt, at most."""

from kvbench.policies.statistics.declared import Replayed, declare

declare(
    Replayed(
        "replay_max",
        "the largest attention probability a reconstruction query of the prompt's replay gave the entry",
    )
)
