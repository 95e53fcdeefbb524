"""KVgrad (kvpress's KVgradPress; OpenReview cg1wTCJjjk): KVzip's replay, each entry weighed by how much the
model's output moves with what it writes, by input × gradient attribution."""

from __future__ import annotations

from kvbench.policies.inputs import Replay
from kvbench.policies.parts import register_score
from kvbench.policies.scores.kvzip import KVzip


@register_score("kvgrad")
class KVgrad(KVzip):
    """An entry c of layer l scores max_p A_pc · ‖v_c W_o‖ · ‖∂Φ/∂a_p‖ over the queries p of KVzip's "repeat the
    previous context" passes (``chunk`` prompt tokens each) and over the query heads of its GQA group: A is
    KVzip's reconstruction attention (over the sinks, the chunk and the pass's own tokens), ‖v_c W_o‖ the norm of
    what the entry writes through the query head's output projection, and ∂Φ/∂a_p the gradient at the query's
    attention output of Φ = Σ_p ‖h_p‖², h the pass's last decoder layer outputs (before the final norm). Each pass
    runs a backward through the model (its weights frozen, the cached prompt entries constants), inside the
    prefill: its time and peak memory are the prefill's. The gradient is taken at the attention module's output,
    which is the residual stream's increment where the family adds it unnormalised (Llama, Qwen, Mistral); a
    family that normalises it first (Gemma's post-attention norm) gets the gradient before that norm."""

    def __init__(self, chunk: int = 512, n_sink: int = 4, postfix: int = 8):
        super().__init__(chunk, n_sink, False, postfix)
        self.replay = Replay(int(chunk), int(n_sink), False, int(postfix), gradient=True)
        self.weights = frozenset({"output_projection"})
