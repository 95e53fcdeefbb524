"""What a layer holds, as the policy parts see it: one dense row per KV head of positions, statistics, features,
keys and values, with each row's padding zeroed, never kept, and left out of the view's sums and means."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvbench.policies.positions import RowRope
from kvbench.stages import Phase


class Stats(dict):
    """Per-token statistics by name; those in ``lazy`` are computed when first read (a per-head-allocated
    layer's query log is a large gather that most scores never need whole). ``get`` does not compute them."""

    def __init__(
        self, eager: dict[str, torch.Tensor] | None = None, lazy: dict[str, Callable[[], torch.Tensor]] | None = None
    ):
        super().__init__(eager or {})
        self._lazy = dict(lazy or {})

    def __missing__(self, name: str) -> torch.Tensor:
        if name not in self._lazy:
            raise KeyError(name)
        self[name] = value = self._lazy.pop(name)()
        return value

    def __contains__(self, name: object) -> bool:
        return super().__contains__(name) or name in self._lazy


class TokenState:
    """What a layer holds right now: one row per KV head, the view every score, scope and allocation reads.

    Per row: ``positions`` [H, n] (absolute sequence positions), ``stats`` {name: [H, n]} (the statistics and
    write-time features the parts declared), ``keys``/``values`` [H, n, D] (loaded when first read), ``row_sums``
    {name: [H, F]} (declared running quantities, see ``policies.running``), ``queries`` [H, group, k, D] (the
    evicting step's last queries, where the score declared them: ``policies.inputs.Queries``) and, when a score
    keeps a query log, ``stats["qlog"]`` [H, W, n] (the rows as its ``log_rows`` made them).

    Rows may hold different counts (per-head allocation): each row's entries then come first, in sequence order,
    and padding fills the rest up to the longest row. A part need not know: padding reads as zero everywhere
    (statistics, features, keys, values), ``sum`` and ``mean`` leave it out, and ``Policy`` never keeps it,
    whatever the score gives it. ``valid`` [H, n] marks the real entries (None: no padding; ``valid_mask()``
    always gives a mask) and ``lengths()`` counts them, for the parts that want them.

    ``phase`` is "prefill" while the prompt is being encoded and "decode" while tokens are generated.
    ``window`` (a sliding-window layer's) and ``seen`` (tokens fed so far, [rows, 1] or an int): the next query
    sees only entries at positions above ``seen - window``; ``prompt`` ([rows, 1] or an int): tokens fed in prompt
    steps (the prompt and its suffix), so that a part can tell the prompt's entries from generated ones. ``seed``
    and ``row_keys`` ([rows, 1]: each row's layer and head, the same for a sequence in any batch) seed random
    scores. The rows come in ``units`` equal
    blocks, one per (layer, sequence): a part that mixes rows (a split across heads, a kept set shared by heads)
    mixes those of one unit only (``per_unit``). ``derived`` presets quantities of ``derived()`` that the cache
    computes more cheaply itself, ``lengths`` the count per row. ``rope`` (where the score declared ``rope``):
    each row's RoPE, to rotate vectors to positions and read ``keys_before_rope``.

    ``observe``: how many of the prompt's last tokens are its question, where the engine compresses the question with
    the context for a score that observes it (``Score.question``); None otherwise.

    While the policy evicts, ``budget`` is the eviction's per-row budget (the average under per-head allocation),
    and ``ranked`` and ``kept_by`` apply its scope and allocation to any scores (None and errors outside).
    """

    def __init__(
        self,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        stats: dict[str, torch.Tensor] | None = None,
        phase: str = "prefill",
        valid: torch.Tensor | None = None,
        load_kv: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
        derived: dict[str, torch.Tensor] | None = None,
        lengths: torch.Tensor | None = None,
        units: int = 1,
        window: int | None = None,
        seen: torch.Tensor | int | None = None,
        prompt: torch.Tensor | int | None = None,
        seed: int = 0,
        row_keys: torch.Tensor | None = None,
        row_sums: dict[str, torch.Tensor] | None = None,
        queries: torch.Tensor | None = None,
        rope: RowRope | None = None,
        budget: int | None = None,
        observe: int | None = None,
    ):
        if positions is None:
            raise ValueError("TokenState needs positions")
        if phase not in tuple(Phase):
            raise ValueError(f"phase {phase!r} must be one of {[p.value for p in Phase]}")
        self._kv = None if keys is None or values is None else (keys, values)
        self._load_kv = load_kv
        self.positions = positions
        self.stats = stats or {}
        self.phase = phase
        self.valid = valid
        self._derived: dict[str, torch.Tensor] = dict(derived or {})
        self._lengths = lengths
        self.units = units
        self.window, self.seen, self.prompt = window, seen, prompt
        self.seed = seed
        self.row_keys = (
            row_keys if row_keys is not None else torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)
        )
        self.row_sums = row_sums or {}
        self.queries = queries
        self.rope, self.budget = rope, budget
        self.observe = observe
        self._zeroed = False
        self._rank: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._keep: Callable[[torch.Tensor], torch.Tensor] | None = None

    def evicting(
        self,
        budget: int,
        rank: Callable[[torch.Tensor], torch.Tensor],
        keep: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Set by the policy before it calls the score: the eviction's budget and how it ranks and keeps."""
        self.budget, self._rank, self._keep = budget, rank, keep

    def ranked(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` [H, n] as this eviction ranks them: +inf on what the scope protects, -inf on padding and on
        entries the next query cannot see (for a score built in stages on another's ranking, CriticalKV's)."""
        if self._rank is None:
            raise ValueError("this TokenState is not being evicted from: no ranking to apply")
        return self._rank(scores)

    def kept_by(self, scores: torch.Tensor) -> torch.Tensor:
        """Bool [H, n]: what this eviction would keep were ``scores`` the score (scope and allocation included,
        e.g. the per-head budgets Ada-KV would give)."""
        if self._keep is None:
            raise ValueError("this TokenState is not being evicted from: no allocation to apply")
        return self._keep(scores)

    def outside_window(self) -> torch.Tensor | None:
        """Bool [H, n]: entries the next query cannot see (a sliding-window layer's), or None."""
        if self.window is None or self.seen is None:
            return None
        return self.positions <= self.seen - self.window

    def derived(self, name: str, compute: Callable[[TokenState], torch.Tensor]) -> torch.Tensor:
        """A quantity computed from this state once, shared by the parts that read it (RoCo's mean
        attention is the score, and the robust scope's deviation is built on it)."""
        if name not in self._derived:
            self._derived[name] = compute(self)
        return self._derived[name]

    def _loaded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values, padding zeroed (loaded on the first read)."""
        if self._kv is None:
            if self._load_kv is None:
                raise ValueError("this TokenState carries no keys/values")
            self._kv, self._load_kv = self._load_kv(), None
        if not self._zeroed:
            self._kv = (self.masked(self._kv[0]), self.masked(self._kv[1]))
            self._zeroed = True
        return self._kv

    @property
    def keys(self) -> torch.Tensor:
        """[H, n, D] in sequence order, zero on padding."""
        return self._loaded()[0]

    @property
    def values(self) -> torch.Tensor:
        """[H, n, Dv] in sequence order, zero on padding."""
        return self._loaded()[1]

    @property
    def keys_before_rope(self) -> torch.Tensor:
        """[H, n, D]: the keys as the model's projection gave them, before its RoPE (zero on padding)."""
        if self.rope is None:
            raise ValueError("keys before RoPE need a score that declares rope = True")
        return self.masked(self.rope.before_rope(self.keys, self.positions))

    @property
    def keys_after_rope(self) -> torch.Tensor:
        """[H, n, D]: the keys rotated at their absolute positions, as a prompt's attention saw them, whatever the
        positions mode (a reindexing cache stores them un-rotated; zero on padding)."""
        if self.rope is None:
            raise ValueError("keys after RoPE need a score that declares rope = True")
        return self.masked(self.rope.after_rope(self.keys, self.positions))

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [H, n, ...] with its padding set to zero (``x`` itself when there is none)."""
        if self.valid is None:
            return x
        return x.masked_fill(~self.valid.view(*self.valid.shape, *(1,) * (x.dim() - 2)), 0)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per row, ``x`` [H, n, ...] summed over the row's entries (padding left out): [H, ...]."""
        return self.masked(x).sum(dim=1)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """Per row, the mean of ``x`` [H, n, ...] over the row's entries (padding left out): [H, ...]."""
        count = self.lengths().clamp_min(1).to(x.dtype if x.is_floating_point() else torch.float32)
        return self.sum(x) / count.view(-1, *(1,) * (x.dim() - 2))

    def per_unit(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [H, ...] as [units, heads, ...]: the rows of each (layer, sequence) together."""
        return x.reshape(self.units, -1, *x.shape[1:])

    @property
    def length(self) -> int:
        """Padded length (the longest head's count)."""
        return self.positions.shape[-1]

    @property
    def heads(self) -> int:
        return self.positions.shape[0]

    def lengths(self) -> torch.Tensor:
        """Tokens held per head, long [H] (``lengths`` when the layer gave them)."""
        if self._lengths is not None:
            return self._lengths
        if self.valid is None:
            return torch.full((self.heads,), self.length, dtype=torch.long, device=self.positions.device)
        return self.valid.sum(dim=-1)

    def valid_mask(self) -> torch.Tensor:
        if self.valid is None:
            return torch.ones_like(self.positions, dtype=torch.bool)
        return self.valid
