"""The query log (SnapKV's observation window, ScissorHands' hits)."""

from kvbench.policies.statistics.declared import Logged, declare

declare(Logged("qlog", "the rows of the last `history` queries (Score.log_rows)"))
