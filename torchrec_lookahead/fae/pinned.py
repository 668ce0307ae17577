"""Pinned hot rows: FAE's hot embeddings kept in the lookahead cache, never evicted.

A cached table of capacity ``C`` with ``P`` hot rows splits its slots in two: slots ``[0, P)`` hold the hot rows
(hot id ``hot_ids[i]`` in slot ``i``), loaded once per plan stream and never evicted; slots ``[P, C)`` are the
dynamic cache the :class:`~torchrec_lookahead.oracle.LookaheadOracle` plans. :class:`PinnedRows` turns one into
the other:

* :meth:`~PinnedRows.pin_plan` loads the hot rows (with their optimizer state) into their slots;
* :meth:`~PinnedRows.hot_plan` maps a hot batch's ids to pinned slots: no fetch, no eviction, no store traffic;
* :meth:`~PinnedRows.cold_part` drops the hot ids of a cold batch, so the oracle plans only the rest, with
  capacity ``C - P`` (:meth:`~PinnedRows.dynamic_capacity`);
* :meth:`~PinnedRows.lift` maps that plan back to the whole cache: its slots move up by ``P`` and the hot ids
  of the batch get their pinned slots.

Because a pinned row is an ordinary cache row, the cache's own lookups, fused optimizer, flush and checkpoint
cover it, and training stays exactly equal to resident training of the same batch stream.

Example:
    >>> import torch
    >>> from torchrec import KeyedJaggedTensor
    >>> from torchrec_lookahead.oracle.types import BatchPlan, TablePlan
    >>> pins = PinnedRows({"t": torch.tensor([3, 7])}, {"f": "t"}, {"t": 5}, {"t": 100})
    >>> pins.dynamic_capacity()
    {'t': 3}
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([7, 40, 3]), torch.tensor([2, 1]))
    >>> pins.cold_part(kjt).values().tolist(), pins.cold_part(kjt).lengths().tolist()
    ([40], [1, 0])
    >>> e = torch.empty(0, dtype=torch.long)
    >>> plan = BatchPlan(0, {"t": TablePlan(e, e, torch.tensor([40]), torch.tensor([0]), torch.tensor([0]))})
    >>> lifted = pins.lift(plan, kjt)
    >>> lifted.tables["t"].fetch_slots.tolist(), lifted.tables["t"].slots.tolist()
    ([2], [1, 2, 0])
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.errors import CapacityError, ConfigError, DataError, InvalidIdError
from torchrec_lookahead.oracle import UnknownFeatures, table_ids
from torchrec_lookahead.oracle.types import BatchPlan, TablePlan

__all__ = ["PinnedRows"]

_EMPTY = torch.empty(0, dtype=torch.int64)


class PinnedRows:
    """The hot rows of the cached tables, pinned in the first slots of each table's cache.

    Args:
        hot_ids: table name -> sorted unique int64 hot ids (tables that are not cached are ignored).
        feature_to_table: feature -> table, for the cached tables' features.
        capacity: cached table -> cache rows (pinned plus dynamic).
        num_embeddings: cached table -> rows of the table.
        slot_spaces: slot space -> the cached tables sharing one cache (the cache's ``slot_spaces``): the
            space's first slots hold its members' hot rows, member after member, and the oracle plans the rest
            of the space; a table in none has a cache of its own.

    Raises:
        InvalidIdError: a hot id is outside its table.
        ConfigError: hot ids are not sorted and unique.
        CapacityError: a table's hot rows leave no room for the dynamic cache (capacity <= hot rows).
    """

    def __init__(
        self,
        hot_ids: Mapping[str, torch.Tensor],
        feature_to_table: Mapping[str, str],
        capacity: Mapping[str, int],
        num_embeddings: Mapping[str, int],
        slot_spaces: Optional[Mapping[str, Sequence[str]]] = None,
    ) -> None:
        self.feature_to_table = dict(feature_to_table)
        self.capacity = {t: int(c) for t, c in capacity.items()}
        self.hot_ids: Dict[str, torch.Tensor] = {}
        self._slot_of: Dict[str, np.ndarray] = {}
        #: per table, the first pinned slot of its hot rows, and how far its space's dynamic slots are shifted
        self._base: Dict[str, int] = {}
        self._shift: Dict[str, int] = {}
        for table in self.capacity:
            ids = hot_ids.get(table)
            ids = _EMPTY if ids is None else torch.as_tensor(ids).to("cpu", torch.int64).flatten()
            rows = int(num_embeddings[table])
            if ids.numel():
                lo, hi = int(ids.min()), int(ids.max())
                if lo < 0 or hi >= rows:
                    raise InvalidIdError(
                        f"hot id {lo if lo < 0 else hi} of table '{table}' is outside [0, {rows}); the hot set "
                        "was calibrated for other tables: calibrate again",
                        table=table,
                        id=lo if lo < 0 else hi,
                        num_rows=rows,
                    )
                if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
                    raise ConfigError(f"hot ids of table '{table}' must be sorted and unique")
            self.hot_ids[table] = ids
        # a cache: a table alone, or the tables of a shared slot space (their capacities summed)
        # (a space of one table is that table's cache, by the table's name, as the oracle names its unit)
        spaces = {
            (k if len(m) > 1 else m[0]): tuple(m)
            for k, m in (slot_spaces or {}).items()
            if m and all(t in self.capacity for t in m)
        }
        inside = {t for m in spaces.values() for t in m}
        spaces.update({t: (t,) for t in sorted(self.capacity) if t not in inside})
        #: cache name (the table, or the shared slot space) -> its tables
        self.caches: Dict[str, Tuple[str, ...]] = spaces
        self._dynamic: Dict[str, int] = {}
        for name, members in spaces.items():
            self._check_room(name, members, num_embeddings)
            self._dynamic.update(_share(members, self.capacity, self.pinned_rows))
            total = sum(int(self.hot_ids[t].numel()) for t in members)
            base = 0
            for table in members:
                ids = self.hot_ids[table]
                slot_of = np.full(int(num_embeddings[table]), -1, dtype=np.int64)
                slot_of[ids.numpy()] = np.arange(base, base + ids.numel(), dtype=np.int64)
                self._slot_of[table] = slot_of
                self._base[table], self._shift[table] = base, total
                base += ids.numel()

    def _check_room(self, name: str, members: Tuple[str, ...], num_embeddings: Mapping[str, int]) -> None:
        """Refuse a cache whose pinned rows leave its oracle no slot (one per table of a shared cache)."""
        cap = sum(self.capacity[t] for t in members)
        pins = sum(int(self.hot_ids[t].numel()) for t in members)
        if pins + len(members) <= cap:
            return
        if len(members) == 1:
            what = f"table '{name}' pins {pins:,} hot rows in a cache of {cap:,} rows"
        else:
            each = ", ".join(f"{t} {int(self.hot_ids[t].numel()):,}" for t in members)
            what = (
                f"the cache shared by tables {list(members)} (the sum of their capacities, {cap:,} rows) pins "
                f"{pins:,} hot rows ({each})"
            )
        # a cache holds at most its table's rows: a wholly hot table cannot be given room, it stays resident
        whole = [t for t in members if int(self.hot_ids[t].numel()) >= int(num_embeddings[t])]
        fix = (
            f"every row of {whole if len(whole) > 1 else repr(whole[0])} is hot: leave "
            f"{'them' if len(whole) > 1 else 'it'} out of capacity (resident tables), or lower hot_budget_bytes "
            "or small_table_bytes"
            if whole
            else "raise the capacity (or the device budget) above the hot rows plus the cold working set, or lower "
            "hot_budget_bytes"
        )
        raise CapacityError(
            f"{what}, which leaves no room for the cold rows; {fix}",
            table=name,
            needed=pins + len(members),
            available=cap,
        )

    @property
    def pinned_rows(self) -> Dict[str, int]:
        """Cached table -> pinned (hot) rows."""
        return {t: int(ids.numel()) for t, ids in self.hot_ids.items()}

    @property
    def pinned_slots(self) -> Dict[str, Tuple[int, int]]:
        """Per cached table, the slots of its pinned rows as (first slot, rows)."""
        return {t: (self._base[t], int(ids.numel())) for t, ids in self.hot_ids.items()}

    def dynamic_capacity(self) -> Dict[str, int]:
        """Cached table -> slots left to the oracle (capacity minus pinned rows). The tables of a shared cache
        are planned in one space of the sum of theirs; a table whose hot rows fill its own share takes one slot
        of another's, so each keeps at least one."""
        return dict(self._dynamic)

    def whole_cache_error(self, err: CapacityError) -> CapacityError:
        """``err``, the oracle's refusal of a cold window in the dynamic slots, in the words of the whole cache
        (the capacities given, the pinned rows besides the window's need); ``err`` itself when it names no
        cache of these rows or its facts are missing.

        Example:
            >>> pins = PinnedRows({"t": torch.tensor([3, 7])}, {"f": "t"}, {"t": 5}, {"t": 100})
            >>> err = CapacityError("table 't': ...", table="t", batch=4, needed=6, available=3)
            >>> whole = pins.whole_cache_error(err)
            >>> str(whole).split(" but ")[0].split(": ")[1]
            'cold batch 4 (counted among the cold batches) needs 6 cache rows besides its 2 pinned hot rows'
            >>> whole.needed, whole.available
            (8, 5)
        """
        members = self.caches.get(str(err.table))
        if members is None or err.needed is None or err.batch is None:
            return err
        pins = sum(self.pinned_rows[t] for t in members)
        cap = sum(self.capacity[t] for t in members)
        window = (
            f"cold batch {err.batch} (counted among the cold batches) needs {err.needed} cache rows besides"
        )
        if len(members) == 1:
            what = f"table {members[0]!r}: {window} its {pins} pinned hot rows but capacity[{members[0]!r}] is {cap}"
            fix = "raise it"
        else:
            what = (
                f"the cache shared by tables {list(members)} (the sum of their capacities, {cap} rows): {window} "
                f"their {pins} pinned hot rows but it holds {cap}"
            )
            fix = "raise the capacities of these tables"
        return CapacityError(
            f"{what}; {fix} to at least {err.needed + pins}{' together' if len(members) > 1 else ''} (or the device "
            "budget), lower prefetch_depth or the horizon, or use smaller batches",
            table=err.table,
            batch=err.batch,
            needed=err.needed + pins,
            available=cap,
        )

    def pin_plan(self, step: int = -1) -> BatchPlan:
        """The plan that loads every hot row into its pinned slot (apply to an empty cache)."""
        return BatchPlan(
            step,
            {
                t: TablePlan(
                    _EMPTY, _EMPTY, ids, torch.arange(ids.numel(), dtype=torch.int64) + self._base[t], _EMPTY
                )
                for t, ids in self.hot_ids.items()
                if ids.numel()
            },
        )

    def _slots(self, table: str, ids: torch.Tensor) -> np.ndarray:
        arr = ids.to("cpu", torch.int64).numpy()
        rows = self._slot_of[table].size
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= rows):
            bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
            raise InvalidIdError(
                f"table '{table}' is looked up with id {bad} outside [0, {rows})",
                table=table,
                id=bad,
                num_rows=rows,
            )
        return self._slot_of[table][arr]

    def hot_plan(self, kjt: KeyedJaggedTensor, step: int) -> BatchPlan:
        """The plan of a hot batch: every id of the cached tables maps to its pinned slot; nothing moves.

        Raises:
            DataError: an id of a cached table is not hot (the batch is not a hot batch).
        """
        tables: Dict[str, TablePlan] = {}
        for table, ids in table_ids(
            kjt, self.feature_to_table, self.capacity, unknown=UnknownFeatures.IGNORE
        ).items():
            slots = self._slots(table, ids)
            if slots.size and int(slots.min()) < 0:
                bad = int(ids[torch.from_numpy(slots < 0)][0])
                raise DataError(
                    f"a hot batch looks up id {bad} of table '{table}', which is not a hot row; hot batches "
                    "must come from the same hot set as the pinned rows"
                )
            tables[table] = TablePlan(_EMPTY, _EMPTY, _EMPTY, _EMPTY, torch.from_numpy(slots))
        return BatchPlan(step, tables)

    def _hot_masks(self, kjt: KeyedJaggedTensor) -> Dict[str, np.ndarray]:
        return {
            t: self._slots(t, ids) >= 0
            for t, ids in table_ids(
                kjt, self.feature_to_table, self.capacity, unknown=UnknownFeatures.IGNORE
            ).items()
        }

    def cold_part(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``kjt`` without the hot ids of the cached tables (the oracle's input); other features unchanged."""
        values = kjt.values()
        keep = np.ones(values.numel(), dtype=bool)
        bounds = kjt.offset_per_key()
        masks = self._hot_masks(kjt)
        used: Dict[str, int] = {}
        for i, key in enumerate(kjt.keys()):
            table = self.feature_to_table.get(key)
            if table not in masks:
                continue
            lo, hi = bounds[i], bounds[i + 1]
            pos = used.get(table, 0)
            keep[lo:hi] = ~masks[table][pos : pos + hi - lo]
            used[table] = pos + hi - lo
        if keep.all():
            return kjt
        kept = np.concatenate([[0], np.cumsum(keep, dtype=np.int64)])
        offsets = kjt.offsets().to("cpu", torch.int64).numpy()
        lengths = np.diff(kept[offsets])
        index = torch.from_numpy(np.flatnonzero(keep))
        weights = kjt.weights_or_none()
        return KeyedJaggedTensor(
            keys=kjt.keys(),
            values=values.index_select(0, index),
            weights=None if weights is None else weights.index_select(0, index),
            lengths=torch.from_numpy(lengths).to(kjt.lengths().dtype),
            stride=kjt.stride(),
        )

    def lift(self, plan: BatchPlan, kjt: KeyedJaggedTensor) -> BatchPlan:
        """Map the oracle's plan of :meth:`cold_part` ``(kjt)`` to the whole cache of ``kjt``'s step."""
        tables: Dict[str, TablePlan] = {}
        ids_of = table_ids(kjt, self.feature_to_table, self.capacity, unknown=UnknownFeatures.IGNORE)
        for table in sorted(set(plan.tables) | {t for t, ids in ids_of.items() if ids.numel()}):
            tp = plan.tables.get(table)
            if tp is None:  # only hot ids of this table at this step: the oracle had nothing to plan
                tp = TablePlan(_EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY)
            if table not in self.hot_ids:
                raise ConfigError(
                    f"plan step {plan.step} names table '{table}' which is not cached; cached tables: "
                    f"{sorted(self.capacity)}"
                )
            pinned = self._shift[table]
            if not pinned:
                tables[table] = tp
                continue
            slots = self._slots(table, ids_of[table]) if table in ids_of else np.zeros(0, dtype=np.int64)
            cold = slots < 0
            if int(cold.sum()) != tp.slots.numel():
                raise DataError(
                    f"plan step {plan.step} has {tp.slots.numel()} slots for the cold ids of table '{table}' but "
                    f"the batch has {int(cold.sum())}; the plan was made for another batch"
                )
            slots[cold] = tp.slots.numpy() + pinned
            tables[table] = TablePlan(
                tp.evict_ids,
                tp.evict_slots + pinned,
                tp.fetch_ids,
                tp.fetch_slots + pinned,
                torch.from_numpy(slots),
                tp.ranks,
            )
        return BatchPlan(plan.step, tables)

    def summary(self) -> List[str]:
        """One line per cache: a table alone, or the tables of a shared cache together (each one's pinned rows
        below), its pinned rows and dynamic slots.

        Example:
            >>> pins = PinnedRows({"a": torch.tensor([1, 2]), "b": torch.tensor([0])}, {}, {"a": 2, "b": 4, "c": 3},
            ...                   {"a": 9, "b": 9, "c": 9}, slot_spaces={"s": ("a", "b")})
            >>> for line in pins.summary():
            ...     print(line)
            tables a, b (one shared cache): 3 pinned + 3 dynamic slots
              each table's pinned rows: a 2, b 1
            c: 0 pinned + 3 dynamic slots
        """
        dyn, pins = self._dynamic, self.pinned_rows
        lines = []
        for members in sorted(self.caches.values()):
            rows = (
                f"{sum(pins[t] for t in members):,} pinned + {sum(dyn[t] for t in members):,} dynamic slots"
            )
            if len(members) == 1:
                lines.append(f"{members[0]}: {rows}")
                continue
            lines.append(f"tables {', '.join(members)} (one shared cache): {rows}")
            lines.append("  each table's pinned rows: " + ", ".join(f"{t} {pins[t]:,}" for t in members))
        return lines


def _share(members: Sequence[str], capacity: Mapping[str, int], pinned: Mapping[str, int]) -> Dict[str, int]:
    """The dynamic slots of each table of one cache: its capacity minus its pinned rows, at least one each (a
    table short of one takes it from the table with the most), the cache's total kept.

    Example:
        >>> _share(["a", "b", "c"], {"a": 2, "b": 4, "c": 3}, {"a": 3, "b": 0, "c": 3})
        {'a': 1, 'b': 1, 'c': 1}
    """
    out = {t: int(capacity[t]) - int(pinned.get(t, 0)) for t in members}
    for t in members:
        while out[t] < 1:
            rich = max(members, key=lambda m: out[m])
            give = min(1 - out[t], out[rich] - 1)
            out[t] += give
            out[rich] -= give
    return out
