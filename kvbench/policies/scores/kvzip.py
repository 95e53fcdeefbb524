"""KVzip (Kim et al. 2025, arXiv:2505.23416): an entry matters as much as the model needs it to repeat the prompt."""

from __future__ import annotations

import torch

from kvbench.policies.base import Score
from kvbench.policies.inputs import Replay
from kvbench.policies.parts import register_score
from kvbench.policies.state import TokenState


@register_score("kvzip")
class KVzip(Score):
    """Each prompt entry's score is the largest attention it receives from the queries of "repeat the previous
    context" passes fed after the prompt, ``chunk`` tokens of it at a time (``policies.inputs.Replay``; the engine
    runs them inside the prefill, ``engine/replay.py``), over query heads of its GQA group and over queries. Each
    pass's softmax spans the first ``n_sink`` entries, the chunk it repeats and its own tokens (kvpress's
    KVzipPress, as the paper's code). ``plus`` (KVzip+): each probability divided by the query's hidden-state norm
    and multiplied by ‖W_o v‖ of its query head. Entries no pass repeats (a chat template's header before the
    text) score 0. Meant for ``allocation: global``: scores of every layer are probabilities, comparable."""

    needs = frozenset({"replay_max"})
    unsupported_stages = ("decode", "both")
    why_unsupported = "KVzip scores the prompt's entries by replaying the prompt once, after it is fed"

    def __init__(self, chunk: int = 2048, n_sink: int = 4, plus: bool = False, postfix: int = 8):
        self.replay = Replay(int(chunk), int(n_sink), bool(plus), int(postfix))
        self.weights = frozenset({"output_projection"}) if plus else frozenset()

    def __call__(self, view: TokenState) -> torch.Tensor:
        return view.stats["replay_max"]
