"""Configuration of the lookahead: how far and how it plans (:class:`LookaheadSettings`, one value read by
the loader that plans and by the budget planner that sizes the caches), the oracle's whole configuration
(:class:`OracleConfig`) and the :class:`Policy` enum.

Example:
    >>> from torchrec_lookahead.oracle import OracleConfig, Policy
    >>> cfg = OracleConfig(capacity={"t0": 4096}, horizon=50, policy="ttl")
    >>> cfg.policy is Policy.TTL
    True
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

from torchrec_lookahead._checks import check_choice, check_int
from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.oracle.batch_ids import UnknownFeatures

__all__ = [
    "Policy",
    "PastHorizon",
    "OracleConfig",
    "LookaheadSettings",
    "MAX_RANKS",
    "DEFAULT_HORIZON",
    "DEFAULT_PREFETCH_DEPTH",
]

#: Batches the oracle reads ahead unless told otherwise: the loader plans this far and the budget planner sizes
#: the caches for it (one default, so that both agree when neither is set).
DEFAULT_HORIZON = 64

#: Steps ahead the stager gathers a plan's rows unless told otherwise.
DEFAULT_PREFETCH_DEPTH = 1

#: Batches per window of the ``window`` policy unless told otherwise.
DEFAULT_WINDOW = 8

#: Largest ``num_ranks`` a reader bit mask in an int64 can hold.
MAX_RANKS = 63

#: Largest ``horizon``: the window keeps the ids of every batch it holds in memory (and sizes its index by the
#: horizon), so a larger one cannot be what a user means.
MAX_HORIZON = 1_000_000

#: Most planner threads ``plan_threads=None`` picks (tables are planned in parallel, one thread per table at a
#: time; beyond a few threads the per-batch hand-off costs more than the tables' work spreads). It picks one
#: thread per four cores: the threads contend for the GIL, and on a 2-core host two were slower than one.
DEFAULT_PLAN_THREADS = 4


class PastHorizon(str, enum.Enum):
    """How the ``belady`` policy orders, for eviction, the resident rows no batch within the horizon reads.

    Attributes:
        REUSE: first the rows not read again since they were fetched (least recently used first: most rows of a
            skewed stream are read once and never again), then the others by the step their last interval
            between two reads predicts for their next read (furthest first; ties least recently used first).
        LRU: least recently used first.
    """

    REUSE = "reuse"
    LRU = "lru"


class Policy(str, enum.Enum):
    """Cache replacement policy of the oracle.

    Attributes:
        BELADY: fixed capacity, evict the id whose next use within the horizon is furthest (default).
        TTL: Bagpipe's oracle cacher: keep an id iff it is used again within the horizon; capacity is an
            upper bound, the rows actually used are reported by ``stats()``.
        WINDOW: cDLRM: every ``window`` batches, place the window's ids in a set-associative cache.
        LRU: least recently used with ``prefetch_depth`` batches of prefetch (FBGEMM-like baseline).
    """

    BELADY = "belady"
    TTL = "ttl"
    WINDOW = "window"
    LRU = "lru"


def check_lookahead(horizon: object, prefetch_depth: object) -> Tuple[int, int]:
    """``(horizon, prefetch_depth)`` as ints, after the one rule every part of the lookahead applies.

    Raises:
        ConfigError: ``prefetch_depth < 0``, ``horizon < prefetch_depth`` or ``horizon > MAX_HORIZON``.
    """
    h = check_int("horizon", horizon, 0, "set how many batches ahead the oracle reads, e.g. 64")
    if h > MAX_HORIZON:
        raise ConfigError(
            f"horizon must be at most {MAX_HORIZON:,} batches but got {h:,}; the oracle keeps every batch of its "
            "window in memory: set how many batches ahead it reads, e.g. 64"
        )
    d = check_int("prefetch_depth", prefetch_depth, 0, "set 0, 1 or more")
    if h < d:
        raise ConfigError(
            f"horizon must be >= prefetch_depth={d} but got horizon={h}; the oracle must see every batch the "
            "stager prefetches: raise horizon or lower prefetch_depth"
        )
    return h, d


@dataclass(frozen=True)
class LookaheadSettings:
    """How far and how the lookahead plans, validated once: the loader that plans
    (:class:`~torchrec_lookahead.data.LookaheadDataModule`, ``LookaheadTrainPipeline``) and the budget planner
    that sizes the caches (:class:`~torchrec_lookahead.distributed.planner.LookaheadPlanner`, the sharder's
    ``planner_options``) read the same fields with the same defaults.

    Args:
        horizon: batches the oracle reads ahead (``>= prefetch_depth``).
        prefetch_depth: steps ahead the stager gathers a plan's rows (``0 <= prefetch_depth <= horizon``).
        policy: a :class:`Policy` or its value.
        window: batches per window of the ``window`` policy (``None``: the oracle's default).
        ways: associativity of the ``window`` policy (``None``: the oracle's default).

    Raises:
        ConfigError: a value out of range or an unknown policy.

    Example:
        >>> s = LookaheadSettings(horizon=16, policy="window", window=8)
        >>> s.policy is Policy.WINDOW, s.oracle_fields()
        (True, {'horizon': 16, 'prefetch_depth': 1, 'policy': <Policy.WINDOW: 'window'>, 'window': 8})
    """

    horizon: int = DEFAULT_HORIZON
    prefetch_depth: int = DEFAULT_PREFETCH_DEPTH
    policy: Union[Policy, str] = Policy.BELADY
    window: Optional[int] = None
    ways: Optional[int] = None

    def __post_init__(self) -> None:
        horizon, depth = check_lookahead(self.horizon, self.prefetch_depth)
        object.__setattr__(self, "horizon", horizon)
        object.__setattr__(self, "prefetch_depth", depth)
        object.__setattr__(self, "policy", check_choice("policy", self.policy, Policy))
        if self.window is not None:
            object.__setattr__(
                self, "window", check_int("window", self.window, 1, "set the cDLRM window length in batches")
            )
        if self.ways is not None:
            object.__setattr__(
                self, "ways", check_int("ways", self.ways, 1, "set the associativity of the window cache")
            )

    @property
    def window_length(self) -> int:
        """The ``window`` policy's window in batches (the oracle's default when ``window`` is unset)."""
        return self.window if self.window is not None else DEFAULT_WINDOW

    def oracle_fields(self) -> Dict[str, Any]:
        """These settings as :class:`OracleConfig` arguments (``window`` and ``ways`` only when set)."""
        out: Dict[str, Any] = {
            "horizon": self.horizon,
            "prefetch_depth": self.prefetch_depth,
            "policy": self.policy,
        }
        out.update({k: v for k, v in (("window", self.window), ("ways", self.ways)) if v is not None})
        return out


def _next_prime_at_most(n: int) -> int:
    """Largest prime <= n (n >= 2)."""
    for p in range(n, 1, -1):
        if all(p % d for d in range(2, int(p**0.5) + 1)):
            return p
    return 2


@dataclass
class OracleConfig:
    """What the oracle plans and how.

    Args:
        capacity: cache rows per cached table; a table absent from the mapping is resident and not planned.
        horizon: how many batches ahead of the current one the oracle reads (next uses are known up to
            ``step + horizon``).
        prefetch_depth: the stager loads rows this many steps ahead; ids of the current batch and of the next
            ``prefetch_depth`` batches are never evicted. Must be ``<= horizon``.
        policy: a :class:`Policy` or its string value.
        num_embeddings: optional rows per table, to refuse out-of-range ids; without it the oracle's per-id
            arrays grow geometrically past the largest id seen, and a table is mapped slot = id until an id
            reaches its capacity (the plans are those with the sizes given whenever that happens in batch 0).
        feature_to_table: optional feature name -> table name; features absent map to a table of their own name
            when this is ``None``. Several features may share a table.
        window: cDLRM window length L (policy ``window``).
        ways: ways per set of the set-associative cache (policy ``window``).
        victim_rows: rows kept aside for set conflicts (policy ``window``); default ``capacity // 8``.
        seed: seed of the random way choice (policy ``window``).
        num_ranks: number of data-parallel ranks W; when W > 1 every table plan carries a ``RankAnnotation``.
        unknown_features: a batch's feature that ``feature_to_table`` does not list is refused (``"error"``)
            or skipped (``"ignore"``: batches that also carry features of tables nobody caches); see
            :class:`~torchrec_lookahead.oracle.UnknownFeatures`.
        plan_threads: threads planning the tables of a batch in parallel (tables are independent; NumPy
            releases the GIL); ``1`` plans them one after the other in the calling thread, ``None`` picks
            ``min(4, os.cpu_count() // 4)``, at least 1. The plans do not depend on it.
        slot_spaces: optional slot-space name -> tables that share one cache of the sum of their capacities
            (a cache kernel's tables of one dimension, as FBGEMM keeps one cache per TBE). The policy plans a
            space as one table, so capacity follows the stream from table to table; every member's plan has the
            space's slots, and its write-backs must land before any member's loads. Members need
            ``num_embeddings``. Tables in no space have a cache of their own.
        past_horizon: how ``belady`` orders the rows with no use within the horizon (:class:`PastHorizon`):
            ``"reuse"`` (default) by what the stream has shown of each row's reuse, ``"lru"`` least recently
            used first.

    Raises:
        ConfigError: any value out of range, an unknown policy, ``horizon < prefetch_depth``.
    """

    capacity: Mapping[str, int]
    horizon: int = DEFAULT_HORIZON
    prefetch_depth: int = DEFAULT_PREFETCH_DEPTH
    policy: Union[Policy, str] = Policy.BELADY
    num_embeddings: Optional[Mapping[str, int]] = None
    feature_to_table: Optional[Mapping[str, str]] = None
    window: int = DEFAULT_WINDOW
    ways: int = 8
    victim_rows: Optional[int] = None
    seed: int = 0
    num_ranks: int = 1
    unknown_features: Union[UnknownFeatures, str] = UnknownFeatures.ERROR
    plan_threads: Optional[int] = None
    slot_spaces: Optional[Mapping[str, Sequence[str]]] = None
    past_horizon: Union[PastHorizon, str] = "reuse"

    def __post_init__(self) -> None:
        if not isinstance(self.capacity, Mapping):
            raise ConfigError(
                f"capacity must be a mapping table name -> rows but got {type(self.capacity).__name__}; "
                "pass e.g. capacity={'t0': 4096}"
            )
        self.capacity = dict(self.capacity)
        for table, rows in self.capacity.items():
            check_int(f"capacity[{table!r}]", rows, 1, "give every cached table a positive number of rows")
        self.policy = check_choice("policy", self.policy, Policy)
        self.past_horizon = check_choice("past_horizon", self.past_horizon, PastHorizon)
        self.horizon, self.prefetch_depth = check_lookahead(self.horizon, self.prefetch_depth)
        if self.policy is Policy.TTL and self.horizon < self.prefetch_depth + 1:
            raise ConfigError(
                f"horizon must be >= prefetch_depth + 1 = {self.prefetch_depth + 1} for policy 'ttl' but got "
                f"horizon={self.horizon}; ttl writes back an id after its last use within the horizon, so the "
                "horizon must cover the next step and the prefetched ones: raise horizon"
            )
        self.window = check_int("window", self.window, 1, "set the cDLRM window length in batches")
        self.ways = check_int("ways", self.ways, 1, "set the associativity of the window cache")
        self.seed = check_int("seed", self.seed, 0, "set a non-negative seed")
        self.num_ranks = check_int("num_ranks", self.num_ranks, 1, "set the data-parallel world size")
        if self.num_ranks > MAX_RANKS:
            raise ConfigError(
                f"num_ranks must be <= {MAX_RANKS} (the reader bit mask is an int64) but got {self.num_ranks}; "
                "annotate at most 63 ranks"
            )
        if self.num_embeddings is not None:
            self.num_embeddings = dict(self.num_embeddings)
            for table, rows in self.num_embeddings.items():
                check_int(f"num_embeddings[{table!r}]", rows, 1, "give every table a positive number of rows")
        if self.feature_to_table is not None:
            self.feature_to_table = dict(self.feature_to_table)
        self.unknown_features = check_choice("unknown_features", self.unknown_features, UnknownFeatures)
        if self.plan_threads is None:
            self.plan_threads = max(1, min(DEFAULT_PLAN_THREADS, (os.cpu_count() or 1) // 4))
        self.plan_threads = check_int(
            "plan_threads",
            self.plan_threads,
            1,
            "set 1 to plan in the calling thread, or None for the default",
        )
        if self.victim_rows is not None:
            check_int(
                "victim_rows", self.victim_rows, 0, "set the number of conflict rows of the window cache"
            )
        if self.slot_spaces is not None:
            self.slot_spaces = self._check_spaces(self.slot_spaces)
        if self.policy is Policy.WINDOW:
            self._validate_window()

    def _check_spaces(self, spaces: Mapping[str, Sequence[str]]) -> Dict[str, Tuple[str, ...]]:
        if not isinstance(spaces, Mapping):
            raise ConfigError(
                f"slot_spaces must be a mapping space name -> tables but got {type(spaces).__name__}; pass e.g. "
                "slot_spaces={'dim64': ['t0', 't1']}"
            )
        out: Dict[str, Tuple[str, ...]] = {}
        owner: Dict[str, str] = {}
        for space, tables in spaces.items():
            if isinstance(tables, str) or not tables:
                raise ConfigError(
                    f"slot_spaces[{space!r}] must be a non-empty list of tables but got {tables!r}"
                )
            if space in self.capacity and tuple(tables) != (space,):
                raise ConfigError(
                    f"slot space {space!r} has the name of a cached table; name slot spaces apart from tables"
                )
            for t in tables:
                if t not in self.capacity:
                    raise ConfigError(
                        f"slot_spaces[{space!r}] names table {t!r}, which has no capacity; cached tables: "
                        f"{sorted(self.capacity)}"
                    )
                if t in owner:
                    raise ConfigError(
                        f"table {t!r} is in slot spaces {owner[t]!r} and {space!r}; give it one"
                    )
                owner[t] = space
            out[str(space)] = tuple(tables)
        return out

    def units(self) -> Dict[str, Tuple[str, ...]]:
        """The planning units, in table order: every slot space of :attr:`slot_spaces` with more than one
        table, and every other cached table alone (a unit of its own name).

        Example:
            >>> OracleConfig(capacity={"a": 4, "b": 4, "c": 4}, num_embeddings={"a": 9, "b": 9, "c": 9},
            ...              slot_spaces={"s": ["a", "c"]}).units()
            {'s': ('a', 'c'), 'b': ('b',)}
        """
        shared = {s: tuple(ts) for s, ts in (self.slot_spaces or {}).items() if len(ts) > 1}
        first = {min(ts): s for s, ts in shared.items()}
        inside = {t for ts in shared.values() for t in ts}
        out: Dict[str, Tuple[str, ...]] = {}
        for t in sorted(self.capacity):
            if t in first:
                out[first[t]] = shared[first[t]]
            elif t not in inside:
                out[t] = (t,)
        return out

    def _validate_window(self) -> None:
        if self.horizon < self.window - 1:
            raise ConfigError(
                f"horizon must be >= window - 1 = {self.window - 1} for policy 'window' but got "
                f"horizon={self.horizon}; the oracle must see the whole window: raise horizon or lower window"
            )
        for table, cap in self.capacity.items():
            if self.direct_mapped(table):
                continue
            victims = self._victims(cap)
            if (cap - victims) // self.ways < 2:
                least = self._least_window_capacity()
                victim = ", or lower victim_rows" if self.victim_rows is not None else ""
                raise ConfigError(
                    f"capacity[{table!r}]={cap} leaves {cap - victims} rows after {victims} victim rows, fewer "
                    f"than 2 sets of ways={self.ways} for policy 'window'; raise the capacity to at least {least}, "
                    f"lower ways{victim}"
                )

    def _least_window_capacity(self) -> int:
        """The least capacity that leaves two sets of ``ways`` after the victim rows."""
        if self.victim_rows is not None:
            return self.victim_rows + 2 * self.ways
        c = 2 * self.ways  # c - c // 8 grows with c
        while c - c // 8 < 2 * self.ways:
            c += 1
        return c

    def _victims(self, capacity: int) -> int:
        """Victim rows of a window cache of ``capacity`` rows (``victim_rows``, default an eighth)."""
        return self.victim_rows if self.victim_rows is not None else capacity // 8

    def direct_mapped(self, table: str) -> bool:
        """Whether the window policy maps ``table`` directly (slot = id): its rows fit in its capacity.

        Args:
            table: a cached table.

        Returns:
            ``True`` when ``num_embeddings[table] <= capacity[table]``.
        """
        rows = None if self.num_embeddings is None else self.num_embeddings.get(table)
        return rows is not None and rows <= self.capacity[table]

    def num_sets(self, table: str) -> int:
        """Sets of the window policy's set-associative cache for ``table``.

        The largest prime ``S`` with ``S * ways <= capacity - victim_rows``; the rows left over
        (``capacity - S * ways``) are all victim rows. 0 when the table is direct mapped.

        Args:
            table: a cached table.

        Returns:
            The number of sets.
        """
        if self.direct_mapped(table):
            return 0
        cap = self.capacity[table]
        victims = self._victims(cap)
        return _next_prime_at_most(max(2, (cap - victims) // self.ways))
