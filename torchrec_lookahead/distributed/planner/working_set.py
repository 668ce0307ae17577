"""Sampled working sets: per-table ids of a few batches, the oracle's capacity floor and fetch curves.

The planner reads a bounded sample of the training stream once, as ids per table::

    sample batch b:   {"t_cat_0": LongTensor(n_0), "t_cat_1": LongTensor(n_1), ...}
    TableSamples:     {"t_cat_0": [ids of batch 0, ids of batch 1, ...], ...}   (int64 numpy arrays)

From it come the smallest capacity the oracle accepts (:func:`min_capacities`: the most unique ids of one
batch together with the next ``prefetch_depth`` batches) and the number of rows the oracle fetches per step
at a given capacity (:func:`simulate_fetches`, which runs :class:`~torchrec_lookahead.oracle.LookaheadOracle`
itself on the sample).

Example:
    >>> import torch
    >>> samples = collect_samples([{"t": torch.tensor([1, 2, 1])}, {"t": torch.tensor([3])},
    ...                            {"t": torch.tensor([4, 5])}], {"t": 8})
    >>> min_capacities(samples, prefetch_depth=1)
    {'t': 3}
    >>> simulate_fetches(samples["t"], 3, horizon=2, prefetch_depth=1, policy="belady", warmup_batches=0)
    1.6666666666666667
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from torchrec_lookahead.errors import CapacityError, ConfigError, InvalidIdError
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig, Policy, table_ids, window_working_sets
from torchrec_lookahead.oracle.batch_ids import ids_array

__all__ = [
    "TableSamples",
    "table_id_batches",
    "batch_table_ids",
    "collect_samples",
    "min_capacities",
    "dense_ids",
    "simulate_fetches",
]

#: table name -> ids looked up by each sampled batch (1-D int64 arrays, one per batch, in stream order).
TableSamples = Dict[str, List[np.ndarray]]


def table_id_batches(
    batches: Iterable[Any], feature_to_table: Mapping[str, str]
) -> Iterator[Dict[str, torch.Tensor]]:
    """Per-table ids of each batch: the ids of features sharing a table are concatenated in key order.

    Args:
        batches: KeyedJaggedTensors, TorchRec ``Batch`` es (their ``sparse_features``) or mappings
            feature -> ids.
        feature_to_table: feature name -> table name (e.g. from the tables' ``feature_names``).

    Yields:
        One mapping table -> (n,) int64 ids per batch (only the tables some feature of the batch maps to).

    Raises:
        ConfigError: a feature of a batch is not in ``feature_to_table``.

    Example:
        >>> from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
        >>> kjt = KeyedJaggedTensor(keys=["a", "b", "c"], values=torch.tensor([3, 9, 4, 9, 5]),
        ...                         lengths=torch.tensor([2, 0, 1, 0, 1, 1]))
        >>> out = next(table_id_batches([kjt], {"a": "t0", "b": "t1", "c": "t0"}))
        >>> {k: v.tolist() for k, v in out.items()}
        {'t0': [3, 9, 9, 5], 't1': [4]}
    """
    for index, batch in enumerate(batches):
        yield batch_table_ids(batch, feature_to_table, index)


def batch_table_ids(
    batch: Any, feature_to_table: Mapping[str, str], index: int = 0
) -> Dict[str, torch.Tensor]:
    """Per-table ids of one batch (see :func:`table_id_batches`).

    Args:
        batch: a KeyedJaggedTensor, a TorchRec ``Batch`` or a mapping feature -> ids.
        feature_to_table: feature name -> table name.
        index: position of the batch in the stream (for error messages).

    Returns:
        table -> (n,) int64 ids.

    Raises:
        ConfigError: a feature is not in ``feature_to_table``.
        DataError: non-integer ids, a batch of another type.
    """
    if hasattr(batch, "sparse_features") and not isinstance(batch, Mapping):
        batch = batch.sparse_features
    return table_ids(batch, feature_to_table, where=f" in sample batch {index}")


def collect_samples(
    batches: Iterable[Mapping[str, Any]],
    num_embeddings: Mapping[str, int],
    max_batches: Optional[int] = None,
) -> TableSamples:
    """Read up to ``max_batches`` batches of ids per table and check them.

    A table absent from a batch looks up nothing in that batch.

    Args:
        batches: mappings table name -> ids (LongTensor or integer array); only ``max_batches`` are read.
        num_embeddings: rows of every table.
        max_batches: how many batches to read at most (``None``: all).

    Returns:
        table -> list of int64 id arrays, one per batch read, for every table of ``num_embeddings``.

    Raises:
        ConfigError: a batch names an unknown table, a batch is not a mapping, or no batch was read.
        DataError: non-integer ids.
        InvalidIdError: an id < 0 or >= the table's rows.

    Example:
        >>> collect_samples([{"t": torch.tensor([0, 2])}], {"t": 3, "u": 5})["u"][0].tolist()
        []
    """
    samples: TableSamples = {name: [] for name in num_embeddings}
    stream = batches if max_batches is None else itertools.islice(batches, max_batches)
    count = 0
    for index, batch in enumerate(stream):
        if not isinstance(batch, Mapping):
            raise ConfigError(
                f"sample batch {index} is a {type(batch).__name__}, not a mapping table -> ids; pass "
                "feature_to_table (or convert with table_id_batches) for KeyedJaggedTensor batches"
            )
        unknown = sorted(str(k) for k in batch if k not in num_embeddings)
        if unknown:
            raise ConfigError(
                f"sample batch {index} names unknown table(s) {unknown}; the tables are {sorted(num_embeddings)}: "
                "rename the keys, or pass feature_to_table when the keys are feature names"
            )
        for name, rows in num_embeddings.items():
            ids = (
                ids_array(batch[name], f"ids of table {name!r} in sample batch {index}")
                if name in batch
                else None
            )
            if ids is None or ids.size == 0:
                samples[name].append(np.zeros(0, dtype=np.int64))
                continue
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= rows:
                bad = low if low < 0 else high
                raise InvalidIdError(
                    f"table {name!r}: id {bad} in sample batch {index} is outside the valid range [0, {rows}); "
                    f"fix the ids or the table's num_embeddings"
                )
            samples[name].append(ids)
        count += 1
    if count == 0:
        raise ConfigError(
            "sample_batches yielded no batch; pass at least one batch (a few dozen give a useful plan)"
        )
    return samples


def min_capacities(samples: TableSamples, prefetch_depth: int) -> Dict[str, int]:
    """The oracle's feasibility floor per table: most unique ids of a batch and the next ``prefetch_depth``.

    Args:
        samples: from :func:`collect_samples`.
        prefetch_depth: P, the batches the stager loads ahead.

    Returns:
        table -> rows (0 for a table the sample never looks up).

    Example:
        >>> s = {"t": [np.array([1, 2]), np.array([2, 3]), np.array([4])]}
        >>> min_capacities(s, 0), min_capacities(s, 1), min_capacities(s, 2)
        ({'t': 2}, {'t': 3}, {'t': 4})
    """
    if prefetch_depth < 0:
        raise ConfigError(f"prefetch_depth must be >= 0 but got {prefetch_depth}; set 0, 1 or more")
    out: Dict[str, int] = {}
    for name, batches in samples.items():
        best = 0
        for _, sets in window_working_sets(({name: b} for b in batches), prefetch_depth):
            best = max(best, sets[name][1])
        out[name] = best
    return out


def dense_ids(batches: Sequence[np.ndarray]) -> List[np.ndarray]:
    """Renumber a table's sampled ids to ``0 .. U-1`` keeping their order (U = distinct ids in the sample).

    The belady, ttl and lru policies depend on ids only through equality and order, so their plans on the
    renumbered stream fetch exactly the same rows, while the oracle's per-id arrays shrink from the table's
    rows to U (the window policy's set index ``id % S`` depends on the values: do not renumber for it).

    Args:
        batches: ids of one table per batch.

    Returns:
        The renumbered batches.

    Example:
        >>> [b.tolist() for b in dense_ids([np.array([70, 5]), np.array([5, 900])])]
        [[1, 0], [0, 2]]
    """
    if not batches:
        return []
    flat = np.concatenate(list(batches))
    _, inverse = np.unique(flat, return_inverse=True)
    bounds = np.cumsum([0] + [b.size for b in batches])
    return [inverse[bounds[i] : bounds[i + 1]].astype(np.int64) for i in range(len(batches))]


def simulate_fetches(
    batches: Sequence[np.ndarray],
    capacity: int,
    horizon: int,
    prefetch_depth: int,
    policy: str,
    warmup_batches: int,
    num_embeddings: Optional[int] = None,
    oracle_options: Optional[Mapping[str, Any]] = None,
) -> Optional[float]:
    """Rows the oracle fetches per step for one table at ``capacity``, on the sample.

    Fetches of the first ``warmup_batches`` steps (the cold cache filling up) are not counted; the result is
    the mean over the remaining steps (over all steps when there are no others).

    Args:
        batches: ids of the table per batch.
        capacity: cache rows (>= 1).
        horizon: the oracle's lookahead.
        prefetch_depth: the oracle's prefetch depth.
        policy: a :class:`~torchrec_lookahead.oracle.Policy` value.
        warmup_batches: leading steps not counted.
        num_embeddings: the table's rows, if known.
        oracle_options: further :class:`~torchrec_lookahead.oracle.OracleConfig` arguments (``window``,
            ``ways``, ``victim_rows``, ``seed``).

    Returns:
        Mean fetched rows per counted step, or ``None`` when the policy cannot run at this capacity
        (the oracle raises :class:`~torchrec_lookahead.errors.CapacityError`, or the window policy's
        set-associative cache does not fit).

    Example:
        >>> simulate_fetches([np.array([1, 2]), np.array([3])], 3, 1, 1, "belady", 0)
        1.5
    """
    result = _simulate(
        batches, capacity, horizon, prefetch_depth, policy, warmup_batches, num_embeddings, oracle_options
    )
    return None if result is None else result[0]


def _simulate(
    batches: Sequence[np.ndarray],
    capacity: int,
    horizon: int,
    prefetch_depth: int,
    policy: str,
    warmup_batches: int,
    num_embeddings: Optional[int] = None,
    oracle_options: Optional[Mapping[str, Any]] = None,
) -> Optional[Tuple[float, int]]:
    """:func:`simulate_fetches` and the most rows ever resident (``peak_rows``), or ``None``."""
    try:
        config = OracleConfig(
            capacity={"t": int(capacity)},
            horizon=horizon,
            prefetch_depth=prefetch_depth,
            policy=policy,
            num_embeddings=None if num_embeddings is None else {"t": int(num_embeddings)},
            **dict(oracle_options or {}),
        )
    except ConfigError:
        if Policy(policy) is Policy.WINDOW:
            return None  # too few rows for two sets of ways
        raise
    oracle = LookaheadOracle(config)
    warm = min(warmup_batches, max(len(batches) - 1, 0))
    fetched = 0
    try:
        for plan in oracle.plan_stream({"t": torch.from_numpy(b)} for b in batches):
            if plan.step >= warm:
                fetched += int(plan.tables["t"].fetch_ids.numel())
    except CapacityError:
        return None
    return fetched / max(len(batches) - warm, 1), int(oracle.stats()["t"]["peak_rows"])
