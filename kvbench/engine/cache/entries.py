"""Bookkeeping for every row of every layer: rows of (lane, KV head), each with its own length.

Tensors are [layers, rows, capacity] and indexed by *slot* (where an entry's K/V lives, see ``store``):
``occupied`` (whether a slot holds an entry), ``positions`` (its absolute position, -1 where free), ``table``
(its statistics and write-time features, one column each) and the query log. ``order`` [layers, rows,
capacity] lists each row's slots in sequence order (entry j of row r is slot ``order[l, r, j]`` for
j < ``lengths[l, r]``), which is what scores and scopes rank. A decode step gives each row's new entry its
lowest free slot; a prompt chunk takes the slots after every row's last one. Eviction frees slots and drops them
from ``order``; after a prompt chunk's eviction a layer is *packed* (entries moved to slots ``0:length``, in
order), so the next chunk again starts right after them.
"""

from __future__ import annotations

import torch

from kvbench.engine.cache.query_log import QueryLog
from kvbench.engine.cache.row_sums import RowSums
from kvbench.engine.cache.store import KVStore, flat_slots


class Entries:
    def __init__(
        self,
        layers: int,
        lanes: int,
        heads: int,
        capacity: int,
        columns: list[str],
        history: int,
        device: torch.device,
        row_sums: RowSums | None = None,
    ):
        self.layers, self.lanes, self.heads, self.capacity = layers, lanes, heads, capacity
        self.rows = lanes * heads
        shape = (layers, self.rows, capacity)
        self.lengths = torch.zeros(layers, self.rows, dtype=torch.long, device=device)
        self.occupied = torch.zeros(shape, dtype=torch.bool, device=device)
        self.order = torch.zeros(shape, dtype=torch.long, device=device)
        self.positions = torch.full(shape, -1, dtype=torch.long, device=device)
        self.columns = list(columns)
        self.table = torch.zeros(*shape, len(columns), device=device) if columns else None
        self.log = QueryLog(layers * self.rows, capacity, history, device) if history else None
        # The declared running sums per row (policies.running): every slot freed here leaves them first.
        self.row_sums = row_sums
        # Per layer, an upper bound on the slots any row uses (host-side: slots 0:slots_used[l] are a step's keys).
        self.slots_used = [0] * layers
        self.device = device

    # -- indices -------------------------------------------------------------------------------------------
    def row_range(self, lo: int, hi: int) -> slice:
        """A layer's rows of lanes ``lo:hi``."""
        return slice(lo * self.heads, hi * self.heads)

    def flat_rows(self, lo: int, hi: int) -> torch.Tensor:
        """Rows of lanes ``lo:hi`` in every layer, as indices into the flattened [layers × rows]: [layers, r]."""
        local = torch.arange(lo * self.heads, hi * self.heads, device=self.device)
        return torch.arange(self.layers, device=self.device).unsqueeze(1) * self.rows + local

    def _column_at(self, name: str, layer: int, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Flat indices into ``table`` of column ``name`` at the layer's entries (``rows`` [m], ``slots`` [m])."""
        at = (layer * self.rows + rows) * self.capacity + slots
        return at * len(self.columns) + self.columns.index(name)

    def _table(self) -> torch.Tensor:
        assert self.table is not None, "only a policy with columns writes them"
        return self.table

    def write_column(
        self, name: str, layer: int, rows: torch.Tensor, slots: torch.Tensor, values: torch.Tensor
    ) -> None:
        self._table().view(-1)[self._column_at(name, layer, rows, slots)] = values.reshape(-1).to(torch.float32)

    def add_to_column(
        self, name: str, layer: int, rows: torch.Tensor, slots: torch.Tensor, values: torch.Tensor
    ) -> None:
        self._table().view(-1).index_add_(
            0, self._column_at(name, layer, rows, slots), values.reshape(-1).to(torch.float32)
        )

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        """[layers, rows, capacity, ...] as [layers × rows, capacity, ...]."""
        return t.view(self.layers * self.rows, *t.shape[2:])

    # -- a step's new entries ------------------------------------------------------------------------------
    def insert(self, lo: int, hi: int, positions: torch.Tensor) -> tuple[torch.Tensor, list[int], list[bool]]:
        """Entries for the tokens at ``positions`` [lanes hi - lo, q] in every layer's rows of lanes ``lo:hi``.
        Returns their slots [layers, r, q], each layer's slots in use (the step's keys are slots ``0:used``), and
        whether each layer's visible past is gapless, with no free slot in it (q == 1: nothing is masked;
        q > 1: the past before the chunk)."""
        rows, q = self.row_range(lo, hi), positions.shape[1]
        r = rows.stop - rows.start
        lengths = self.lengths[:, rows]
        if q == 1:
            slots = (~self.occupied[:, rows]).to(torch.uint8).argmax(dim=-1, keepdim=True)
            host = torch.stack([slots.amax(dim=(1, 2)) + 1, lengths.amin(dim=1) + 1]).tolist()
            self.slots_used = [max(s, new) for s, new in zip(self.slots_used, host[0])]
            gapless = [low == used for low, used in zip(host[1], self.slots_used)]
        else:
            lows = lengths.amin(dim=1).tolist()
            gapless = [low == used for low, used in zip(lows, self.slots_used)]
            base = torch.tensor(self.slots_used, device=self.device).view(-1, 1, 1)
            slots = (base + torch.arange(q, device=self.device)).expand(-1, r, -1).contiguous()
            self.slots_used = [s + q for s in self.slots_used]
        if max(self.slots_used) > self.capacity:
            raise RuntimeError(f"{max(self.slots_used)} slots exceed the pre-allocated capacity {self.capacity}")
        per_row = positions.repeat_interleave(self.heads, dim=0).unsqueeze(0).expand(self.layers, -1, -1)
        self.positions[:, rows].scatter_(2, slots, per_row)
        self.occupied[:, rows].scatter_(2, slots, True)
        self.order[:, rows].scatter_(2, lengths.unsqueeze(-1) + torch.arange(q, device=self.device), slots)
        self.lengths[:, rows] += q
        if self.table is not None:
            at = slots.unsqueeze(-1).expand(-1, -1, -1, len(self.columns))
            self.table[:, rows].scatter_(2, at, 0.0)
        if self.log is not None:
            self.log.clear(
                flat_slots(self.flat_rows(lo, hi).reshape(-1), slots.reshape(self.layers * r, q), self.capacity)
            )
        return slots, self.slots_used[:], gapless

    def drop(self, lo: int, hi: int, slots: torch.Tensor) -> None:
        """Free the entries a step just wrote in lanes ``lo:hi`` (``slots`` [layers, r, q], each row's newest q),
        as if it had never fed them: a replay pass leaves the prompt's rows as they were."""
        flat, q = self.flat_rows(lo, hi).reshape(-1), slots.shape[2]
        self._free(flat, slots.reshape(flat.shape[0], q))
        self.lengths[:, self.row_range(lo, hi)] -= q
        if q > 1:  # a chunk's entries went right after every row's last slot: those slots are free again
            self.slots_used = [s - q for s in self.slots_used]

    # -- eviction ------------------------------------------------------------------------------------------
    def gather_rows(self, t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Rows ``rows`` (flat indices, None: all) of a [layers, rows, ...] tensor, as [r, ...]."""
        flat = self.flat(t)
        return flat if rows is None else flat.index_select(0, rows)

    def keep_sorted(self, rows: torch.Tensor | None, n: int, kept: torch.Tensor, evicted: torch.Tensor) -> None:
        """Rows of one length ``n`` keep their entries ``kept`` [r, k] (ascending) and free ``evicted``."""
        order = self.gather_rows(self.order, rows)[:, :n]
        self._free(rows, order.gather(1, evicted))
        self._set(self.order, rows, order.gather(1, kept))
        self._set_lengths(rows, kept.shape[1])

    def keep_mask(self, rows: torch.Tensor | None, keep: torch.Tensor, valid: torch.Tensor) -> None:
        """Rows padded to ``n`` entries keep those marked ``keep`` [r, n] and free the other ``valid`` ones."""
        n = keep.shape[1]
        order = self.gather_rows(self.order, rows)[:, :n]
        gone = valid & ~keep
        row_ids = self._row_ids(rows, keep.shape[0])
        if self.row_sums is not None:
            self.row_sums.remove(row_ids, order, gone)
        freed = flat_slots(row_ids, order, self.capacity)[gone.reshape(-1)]
        self.flat(self.occupied).view(-1)[freed] = False
        self.flat(self.positions).view(-1)[freed] = -1
        at = torch.where(keep, keep.cumsum(dim=1) - 1, n)
        packed = order.new_zeros(order.shape[0], n + 1).scatter_(1, at, order)
        self._set(self.order, rows, packed[:, :n])
        counts = keep.sum(dim=1)
        if rows is None:
            self.lengths.view(-1).copy_(counts)
        else:
            self.lengths.view(-1)[rows] = counts

    def _row_ids(self, rows: torch.Tensor | None, count: int) -> torch.Tensor:
        return torch.arange(count, device=self.device) if rows is None else rows

    def _free(self, rows: torch.Tensor | None, slots: torch.Tensor) -> None:
        row_ids = self._row_ids(rows, slots.shape[0])
        if self.row_sums is not None:
            self.row_sums.remove(row_ids, slots)
        at = flat_slots(row_ids, slots, self.capacity)
        self.flat(self.occupied).view(-1)[at] = False
        self.flat(self.positions).view(-1)[at] = -1

    def _set(self, t: torch.Tensor, rows: torch.Tensor | None, values: torch.Tensor) -> None:
        k = values.shape[1]
        if rows is None:
            self.flat(t)[:, :k] = values
        else:
            self.flat(t)[rows.unsqueeze(1), torch.arange(k, device=self.device)] = values

    def _set_lengths(self, rows: torch.Tensor | None, k: int) -> None:
        if rows is None:
            self.lengths.fill_(k)
        else:
            self.lengths.view(-1)[rows] = k

    def pack(self, layer: int, lo: int, hi: int, store: KVStore) -> None:
        """Move every entry of the layer's rows of lanes ``lo:hi`` to slots ``0:length``, in sequence order."""
        rows = self.row_range(lo, hi)
        lengths = self.lengths[layer, rows]
        m = int(lengths.max())
        order = self.order[layer, rows, :m]
        local = torch.arange(rows.start, rows.stop, device=self.device)
        store.reorder(local, order)
        held = torch.arange(self.capacity, device=self.device) < lengths.unsqueeze(1)
        for t in (self.positions, self.table):
            if t is not None:
                part = t[layer, rows]
                idx = order if t.dim() == 3 else order.unsqueeze(-1).expand(-1, -1, t.shape[-1])
                part[:, :m] = part.gather(1, idx)
        self.positions[layer, rows] = self.positions[layer, rows].masked_fill(~held, -1)
        if self.log is not None:
            flat = layer * self.rows + local
            ring = self.log.rows[flat]
            self.log.rows[flat, :, :m] = ring.gather(2, order.unsqueeze(1).expand(-1, ring.shape[1], -1))
            self.log.total[flat, :m] = self.log.total[flat].gather(1, order)
        self.order[layer, rows, :m] = torch.arange(m, device=self.device)
        self.occupied[layer, rows] = held
        self.slots_used[layer] = m

    # -- lanes ---------------------------------------------------------------------------------------------
    def copy_lane(self, source: Entries, src: int, dst: int) -> int:
        """Lane ``src`` of ``source`` becomes lane ``dst`` here (every layer); returns the slots copied."""
        n = max(source.slots_used)
        if n > self.capacity:
            raise RuntimeError(f"a sequence using {n} slots does not fit rows of capacity {self.capacity}")
        a, b = source.row_range(src, src + 1), self.row_range(dst, dst + 1)
        self.lengths[:, b] = source.lengths[:, a]
        for mine, theirs, empty in (
            (self.occupied, source.occupied, False),
            (self.positions, source.positions, -1),
            (self.order, source.order, 0),
            (self.table, source.table, 0.0),
        ):
            if mine is not None:
                assert theirs is not None, "caches of one run keep the same columns"
                mine[:, b, :n] = theirs[:, a, :n]
                mine[:, b, n:] = empty
        if self.log is not None:
            assert source.log is not None, "caches of one run keep the same query log"
            for layer in range(self.layers):
                fa = slice(layer * source.rows + a.start, layer * source.rows + a.stop)
                fb = slice(layer * self.rows + b.start, layer * self.rows + b.stop)
                self.log.rows[fb, :, :n] = source.log.rows[fa, :, :n]
                self.log.total[fb, :n] = source.log.total[fa, :n]
                self.log.nvis[fb] = source.log.nvis[fa]
        if self.row_sums is not None:
            assert source.row_sums is not None, "caches of one run keep the same row sums"
            from_rows, to_rows = source.flat_rows(src, src + 1).view(-1), self.flat_rows(dst, dst + 1).view(-1)
            self.row_sums.copy_rows(source.row_sums, from_rows, to_rows)
        self.slots_used = [max(s, t) for s, t in zip(self.slots_used, source.slots_used)]
        return n

    def kept_positions(self, layer: int, lane: int) -> torch.Tensor:
        """[heads, longest row] in sequence order; a row holding fewer entries repeats its newest position."""
        rows = self.row_range(lane, lane + 1)
        lengths = self.lengths[layer, rows]
        m = int(lengths.max())
        pos = self.positions[layer, rows].gather(1, self.order[layer, rows, :m])
        valid = torch.arange(m, device=self.device) < lengths.unsqueeze(1)
        last = pos.gather(1, (lengths - 1).clamp_min(0).unsqueeze(1))
        return torch.where(valid, pos, last)
