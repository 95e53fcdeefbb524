"""What a score may read besides the entries and their statistics: the step's queries and the layer's weights.

Both are declarations on the score (``Score.queries``, ``Score.weights``), so that the engine hands them over
only to the policies that read them: a score never reaches into the model or the attention function.
"""

from __future__ import annotations

from dataclasses import dataclass

# The layer weights a score's ``features`` may read, by name, and what each is. ``features`` is called with the
# entries of one KV head at a time, and gets that head's part.
WEIGHTS = {
    "output_projection": "the columns of the attention's output projection W_o that read the entries' KV head "
    "(those of its GQA group's query heads), [hidden, group × head_dim]"
}


# ``Queries(last=EVERY)``: every query of the evicting step (a prompt fed in one step: one per entry it wrote).
EVERY = 1 << 30


@dataclass(frozen=True)
class Queries:
    """The evicting step's last ``last`` queries (fewer if the step has fewer), as ``TokenState.queries``
    [rows, group, k, D]: each KV head row gets its GQA group's query heads. ``rope``: as the attention saw them
    (True) or before the rotary embedding (False: e.g. to extrapolate them to coming positions). ``ahead`` > 0
    (with ``rope=False``): each turned by the mean of the model's rotations over the ``ahead`` positions after
    the step (``Rotary.averaged``): the query as it would attend on average over the coming positions, so that
    their mean and covariance are those of the rotated statistics (Expected Attention). ``scaled``: times the
    family's attention scaling (what multiplies qᵀk before the softmax), for a score that computes the model's
    own attention probabilities (a family's logit softcap is not applied)."""

    last: int
    rope: bool = True
    ahead: int = 0
    scaled: bool = False

    def __post_init__(self) -> None:
        if int(self.last) < 1:
            raise ValueError(f"queries.last={self.last} must be >= 1")
        if int(self.ahead) < 0:
            raise ValueError(f"queries.ahead={self.ahead} must be >= 0")
        if self.ahead and self.rope:
            raise ValueError("queries.ahead turns the queries before RoPE: it needs rope=False")


@dataclass(frozen=True)
class Replay:
    """A score that ranks the prompt by how its entries serve a reconstruction of it (KVzip): after the prompt,
    the engine feeds "repeat the previous context" passes, ``chunk`` prompt tokens each, over the whole prompt's
    cache, inside the prefill; the attention of each pass's queries over the first ``n_sink`` entries, the chunk
    it repeats and its own tokens gives the chunk's entries their ``replay_max``. ``plus``: each query's
    probabilities divided by its hidden state's norm and multiplied by ‖W_o v‖ of the query head (KVzip+).
    ``gradient``: instead, each query's probabilities multiplied by the norm of the gradient, at the attention's
    output, of the pass's objective Φ = Σ ‖h‖² over its last decoder layer's outputs, and by ‖W_o v‖ (KVgrad;
    each pass then runs a backward). ``postfix``: a later pass's instruction ends with the previous chunk's last
    ``postfix`` tokens."""

    chunk: int = 2048
    n_sink: int = 4
    plus: bool = False
    postfix: int = 8
    gradient: bool = False

    def __post_init__(self) -> None:
        if int(self.chunk) < 1:
            raise ValueError(f"replay chunk={self.chunk} must be >= 1 token")
        if int(self.n_sink) < 0 or int(self.postfix) < 0:
            raise ValueError(f"replay n_sink={self.n_sink} and postfix={self.postfix} must be >= 0")
        if self.plus and self.gradient:
            raise ValueError("a replay weighs its queries by KVzip+'s hidden-state norm or KVgrad's gradient, not both")
