"""Private: the slot spaces of a cached collection (:class:`~torchrec_lookahead.modules.CacheLayout`).

A kernel's cached tables of one dimension share one slot space in the pooled layout (each table alone in the per
table layout); a resident table is never in one. Each table keeps its own kernel table, and a space's members use
the storage of its first member (``shares``).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

from torchrec_lookahead._checks import check_choice
from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.modules._plans import _Table
from torchrec_lookahead.modules.config import CacheLayout
from torchrec_lookahead.oracle.batch_ids import UnknownFeatures
from torchrec_lookahead.oracle.config import OracleConfig

__all__: List[str] = []


def kernel_spaces(cfgs: Sequence[Any], capacity: Mapping[str, int], layout: CacheLayout) -> List[List[Any]]:
    """One kernel's tables by slot space: the cached tables of one dimension together (pooled) or each alone
    (per table), every resident table alone; in config order."""
    out: List[List[Any]] = []
    by_dim: Dict[int, List[Any]] = {}
    for c in cfgs:
        if c.name in capacity and layout is CacheLayout.POOLED:
            if c.embedding_dim not in by_dim:
                by_dim[c.embedding_dim] = []
                out.append(by_dim[c.embedding_dim])
            by_dim[c.embedding_dim].append(c)
        else:
            out.append([c])
    return out


def space_name(members: Sequence[Any]) -> str:
    """A slot space's name: its table's alone, else its first table's and how many share it."""
    return str(members[0].name) if len(members) == 1 else f"{members[0].name}+{len(members) - 1}"


def slot_spaces(
    kernels: Iterable[Sequence[Any]], capacity: Mapping[str, int], layout: CacheLayout
) -> Dict[str, Tuple[str, ...]]:
    """Slot space name -> its tables, over the table configs of every kernel."""
    return {
        space_name(m): tuple(c.name for c in m)
        for cfgs in kernels
        for m in kernel_spaces(cfgs, capacity, layout)
        if m[0].name in capacity
    }


def kernel_tables(
    cfgs: Sequence[Any], capacity: Mapping[str, int], layout: CacheLayout
) -> Tuple[List[int], List[int], List[Optional[str]]]:
    """Per table of one kernel: the rows of its kernel table (a cached table's: its slot space's, the sum of its
    members' capacities), the table whose storage it uses, and its slot space (``None``: resident)."""
    space_of = {c.name: m for m in kernel_spaces(cfgs, capacity, layout) for c in m}
    index = {c.name: i for i, c in enumerate(cfgs)}
    rows = [
        sum(int(capacity[m.name]) for m in space_of[c.name]) if c.name in capacity else int(c.num_embeddings)
        for c in cfgs
    ]
    shares = [index[space_of[c.name][0].name] for c in cfgs]
    names = [space_name(space_of[c.name]) if c.name in capacity else None for c in cfgs]
    return rows, shares, names


class SlotSpaceViews:
    """The slot-space side of a cached collection (:class:`~torchrec_lookahead.modules.CachedEmbeddingBagCollection`
    mixes it in): its configured capacities, slot spaces, the rows each table's slots index and the oracle
    configuration that plans it. The collection sets the attributes declared here when it is built."""

    _layout: CacheLayout
    _capacity: Dict[str, int]
    _spaces: Dict[str, Tuple[str, ...]]
    _tables: Dict[str, _Table]
    _feature_to_table: Dict[str, str]

    @classmethod
    def _kernel_group(cls, cfg: Any) -> Tuple[PoolingMode, int]:
        """The kernel a table joins (one per distinct key); the collection's rule."""
        raise NotImplementedError

    @classmethod
    def layout_slot_spaces(
        cls,
        tables: Sequence[Any],
        capacity: Mapping[str, int],
        cache_layout: Union[CacheLayout, str] = CacheLayout.POOLED,
    ) -> Dict[str, Tuple[str, ...]]:
        """The :attr:`slot_spaces` a collection of these tables and capacities has, without building it.

        Example:
            >>> from torchrec import EmbeddingBagConfig
            >>> from torchrec_lookahead.modules import CachedEmbeddingBagCollection
            >>> tables = [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=100, feature_names=[n])
            ...           for n, d in (("a", 4), ("b", 8), ("c", 4))]
            >>> CachedEmbeddingBagCollection.layout_slot_spaces(tables, {"a": 8, "b": 8, "c": 8})
            {'a+1': ('a', 'c'), 'b': ('b',)}
        """
        layout = check_choice("cache_layout", cache_layout, CacheLayout)
        return slot_spaces(cls._kernel_groups(tables).values(), capacity, layout)

    @classmethod
    def _kernel_groups(cls, tables: Sequence[Any]) -> Dict[Tuple[PoolingMode, int], List[Any]]:
        """The table configs by the kernel they join, in config order."""
        groups: Dict[Tuple[PoolingMode, int], List[Any]] = {}
        for cfg in tables:
            groups.setdefault(cls._kernel_group(cfg), []).append(cfg)
        return groups

    @property
    def capacity(self) -> Dict[str, int]:
        """Cached table name -> its cache rows as configured (pooled: its share of its slot space's rows)."""
        return dict(self._capacity)

    @property
    def cache_layout(self) -> CacheLayout:
        """Whether the cached tables of a kernel and dimension share one cache (see :class:`CacheLayout`)."""
        return self._layout

    @property
    def slot_spaces(self) -> Dict[str, Tuple[str, ...]]:
        """Slot space name -> the cached tables sharing its cache rows (a table alone: the table's name); the
        oracle plans each space as one cache (``OracleConfig(slot_spaces=...)``)."""
        return dict(self._spaces)

    def oracle_config(self, **options: Any) -> OracleConfig:
        """The :class:`~torchrec_lookahead.oracle.OracleConfig` that plans this cache: its capacities, slot
        spaces, table sizes and features, with ``options`` (``horizon``, ``prefetch_depth``, ``policy``, ...).

        Example:
            >>> from torchrec import EmbeddingBagConfig
            >>> from torchrec_lookahead.modules import CachedEmbeddingBagCollection
            >>> from torchrec_lookahead.oracle import LookaheadOracle
            >>> tables = [EmbeddingBagConfig(name=n, embedding_dim=4, num_embeddings=100, feature_names=[n + "_f"])
            ...           for n in ("a", "b")]
            >>> ebc = CachedEmbeddingBagCollection(tables, capacity={"a": 8, "b": 8})
            >>> cfg = ebc.oracle_config(horizon=16)
            >>> cfg.slot_spaces, cfg.horizon
            ({'a+1': ('a', 'b')}, 16)
            >>> oracle = LookaheadOracle(cfg)
        """
        cached = {n for n, t in self._tables.items() if t.cached}
        return OracleConfig(
            capacity=self.capacity,
            num_embeddings={n: t.config.num_embeddings for n, t in self._tables.items() if n in cached},
            feature_to_table={f: t for f, t in self._feature_to_table.items() if t in cached},
            slot_spaces=self.slot_spaces,
            **{"unknown_features": UnknownFeatures.IGNORE, **options},
        )

    def cache_rows(self, table: str) -> int:
        """Rows of the cache a cached table's slots index: its slot space's (the sum of its members' capacities).

        Raises:
            ConfigError: the table is unknown or resident.
        """
        t = self._table(table)
        if t.slot_to_id is None:
            raise ConfigError(f"table '{table}' is resident; it has no slots")
        return t.rows

    def _table(self, name: str) -> _Table:
        if name not in self._tables:
            raise ConfigError(f"unknown table '{name}'; tables are {sorted(self._tables)}")
        return self._tables[name]
