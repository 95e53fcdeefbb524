"""What a layer holds, as the policy parts see it: positions, statistics, keys and values, per KV head."""

from __future__ import annotations

from collections.abc import Callable

import torch

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
    """What a layer holds right now, per KV head.

    ``positions`` [H, n] (absolute sequence positions), ``stats`` {name: [H, n]} (attention statistics and the
    score's write-time features) plus, when a score keeps a query log, ``qlog`` [H, W, n] (the rows as the
    score's ``log_rows`` made them) and ``qlog_nvis`` [H, W]; ``keys``/``values`` [H, n, D] (loaded lazily:
    quantised or pooled layers only dequantise/gather them when a part reads them).

    ``valid`` is None when every head holds the same ``n`` tokens. Under per-head allocation heads hold
    different counts; the state is then padded to the longest head and ``valid`` [H, n] marks real entries:
    each head's entries are front-aligned and in sequence order, padding comes after them. Padding entries
    have zero statistics and are never protected or kept.

    ``phase`` is "prefill" while the prompt is being encoded and "decode" while tokens are generated.
    ``derived`` presets quantities of ``derived()`` that the cache can compute more cheaply itself, ``lengths``
    the count per row. The rows come in ``units`` equal blocks, one per (layer, sequence): the KV heads of one
    layer of one sequence. A part that mixes rows (a split across heads, a kept set shared by heads) mixes those
    of one unit only. ``window`` (a sliding-window layer's) and ``seen`` (tokens fed so far, [rows, 1] or an int):
    the next query sees only entries at positions above ``seen - window``. ``seed`` and ``row_keys`` ([rows, 1]:
    each row's layer and head, the same for a sequence in any batch) seed random scores.
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
        seed: int = 0,
        row_keys: torch.Tensor | None = None,
    ):
        if positions is None:
            raise ValueError("TokenState needs positions")
        if phase not in tuple(Phase):
            raise ValueError(f"phase {phase!r} must be one of {[p.value for p in Phase]}")
        self._keys, self._values, self._load_kv = keys, values, load_kv
        self.positions = positions
        self.stats = stats or {}
        self.phase = phase
        self.valid = valid
        self._derived: dict[str, torch.Tensor] = dict(derived or {})
        self._lengths = lengths
        self.units = units
        self.window, self.seen = window, seen
        self.seed = seed
        self.row_keys = (
            row_keys if row_keys is not None else torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)
        )

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
        if self._load_kv is None:
            raise ValueError("this TokenState carries no keys/values")
        keys, values = self._load_kv()
        self._load_kv = None
        return keys, values

    @property
    def keys(self) -> torch.Tensor:
        if self._keys is None:
            self._keys, self._values = self._loaded()
        return self._keys

    @property
    def values(self) -> torch.Tensor:
        if self._values is None:
            self._keys, self._values = self._loaded()
        return self._values

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
