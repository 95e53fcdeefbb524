"""How many queries could see an entry (RoCo's mean and deviation, SnapKV's window)."""

import torch

from kvbench.policies.statistics.declared import FromPositions, declare

declare(
    FromPositions(
        "count",
        "queries that could see the entry: tokens fed since it, itself included",
        lambda seen, positions: (seen - positions).to(torch.float32),
    )
)
