"""The second moment of received attention (RoCo's standard deviation)."""

import torch

from kvbench.policies.statistics.declared import Summed, declare

declare(Summed("sumsq", "the square of the attention probability received, summed likewise", torch.square))
