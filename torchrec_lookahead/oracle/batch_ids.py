"""A batch's ids per table: the one place where features map to tables, for the oracle, the capacity check, the
budget planner's samples, the LRPP tracker and pinned rows.

Several features may share a table; a table's ids are its features' ids concatenated in key order::

    batch keys:  f_a (table t0)   f_b (table t1)   f_c (table t0)
    values:      [3, 9]           [4]              [9, 5, 1]
    ids of t0:   [3, 9, 9, 5, 1]                   (f_a then f_c)

A feature that ``feature_to_table`` does not list is refused (:attr:`UnknownFeatures.ERROR`) or skipped
(:attr:`UnknownFeatures.IGNORE`, for batches that also carry other modules' features).

Example:
    >>> import torch
    >>> batch = {"f_a": torch.tensor([3, 9]), "f_b": torch.tensor([4]), "f_c": torch.tensor([9, 5, 1])}
    >>> {t: v.tolist() for t, v in table_ids(batch, {"f_a": "t0", "f_b": "t1", "f_c": "t0"}).items()}
    {'t0': [3, 9, 9, 5, 1], 't1': [4]}
    >>> table_ids(batch, {"f_a": "t0"}, unknown="ignore")["t0"].tolist()
    [3, 9]
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Collection, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from torchrec_lookahead._checks import check_choice
from torchrec_lookahead.errors import ConfigError, DataError

__all__ = ["UnknownFeatures", "table_ids"]

# table -> (ids (N,) int64, sample index of each id (N,) int64 or None, batch size B or None)
TableIds = Dict[str, Tuple[np.ndarray, Optional[np.ndarray], Optional[int]]]


class UnknownFeatures(enum.StrEnum):
    """What a batch's feature that ``feature_to_table`` does not list means.

    Example:
        >>> UnknownFeatures("ignore") is UnknownFeatures.IGNORE
        True
    """

    ERROR = "error"  #: refuse the batch with a ConfigError naming the feature
    IGNORE = "ignore"  #: skip the feature (it belongs to a table nobody here plans)


def ids_array(x: Any, what: str) -> np.ndarray:
    """``x`` (a tensor, array or sequence of integers) as a flat int64 NumPy array; ``what`` names it in the
    :class:`~torchrec_lookahead.errors.DataError` for non-integer ids."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise DataError(f"{what} must be an integer tensor but got dtype {x.dtype}; pass LongTensor ids")
        return x.detach().to("cpu", torch.int64).contiguous().reshape(-1).numpy()
    arr = np.asarray(x)
    if arr.size and arr.dtype.kind not in "iu":
        raise DataError(f"{what} must hold integers but got dtype {arr.dtype}; pass LongTensor ids")
    return np.ascontiguousarray(arr.reshape(-1), dtype=np.int64)


def _features(batch: Any, wanted: Callable[[str], bool], want_lengths: bool) -> List[Tuple[str, Any, Any]]:
    """(feature, ids, lengths or None) in key order, for a mapping or a KeyedJaggedTensor-like object.

    A mapping's value is ids, or an ``(ids, lengths)`` pair (a tuple or list whose first item is not a number).

    Every feature is listed; ``ids`` (and ``lengths`` when ``want_lengths``) may be ``None`` for a feature that is
    not ``wanted``.
    """
    if isinstance(batch, Mapping):
        out = []
        for key, value in batch.items():
            if isinstance(value, (tuple, list)) and value and not np.isscalar(value[0]):
                if len(value) != 2:
                    raise DataError(
                        f"feature {key!r}: expected ids or (ids, lengths) but got a sequence of {len(value)}; "
                        "pass a LongTensor or a pair"
                    )
                out.append((str(key), value[0], value[1]))
            else:
                out.append((str(key), value, None))
        return out
    if _is_plain_kjt(batch):
        # Slices of the KJT's values (as one NumPy array) and lengths, for the wanted features only
        # (KeyedJaggedTensor.to_dict builds a JaggedTensor per feature, several times slower, and this runs for
        # every batch in the planner thread).
        keys, values, stride = batch.keys(), batch.values(), int(batch.stride())
        flat: Any = values
        try:
            flat = values.detach().to("cpu").contiguous().numpy()
        except TypeError:  # a dtype NumPy lacks (bfloat16): ids_array names the feature in its error
            pass
        lengths = batch.lengths() if want_lengths else None
        out = []
        off = 0
        for i, (key, n) in enumerate(zip(keys, batch.length_per_key())):
            key = str(key)
            if wanted(key):
                lens = lengths[i * stride : (i + 1) * stride] if lengths is not None else None
                out.append((key, flat[off : off + n], lens))
            else:
                out.append((key, None, None))
            off += n
        return out
    if hasattr(batch, "keys") and hasattr(batch, "to_dict"):
        jagged = batch.to_dict()
        out = []
        for key in batch.keys():
            jt = jagged[key]
            lengths = jt.lengths() if hasattr(jt, "lengths") else None
            out.append((str(key), jt.values(), lengths))
        return out
    raise DataError(
        f"a batch must be a mapping name -> ids or a KeyedJaggedTensor-like object (keys(), to_dict()) but got "
        f"{type(batch).__name__}; convert it first"
    )


def _is_plain_kjt(batch: Any) -> bool:
    """A KeyedJaggedTensor-like object with one stride for every key (not variable-batch); duck-typed, as the
    oracle does not depend on TorchRec."""
    needed = ("keys", "values", "lengths", "stride", "length_per_key", "variable_stride_per_key")
    return all(hasattr(batch, a) for a in needed) and not batch.variable_stride_per_key()


def _resolver(
    feature_to_table: Optional[Mapping[str, str]], unknown: Union[UnknownFeatures, str], where: str
) -> Callable[[str], Optional[str]]:
    """feature -> its table, or ``None`` for an unknown feature under :attr:`UnknownFeatures.IGNORE`."""
    mode = check_choice("unknown", unknown, UnknownFeatures)

    def table_of(feature: str) -> Optional[str]:
        if feature_to_table is None:
            return feature
        table = feature_to_table.get(feature)
        if table is None and mode is UnknownFeatures.ERROR:
            raise ConfigError(
                f"feature {feature!r}{where} is not in feature_to_table (known features: "
                f"{sorted(feature_to_table)}); add it to feature_to_table or to a table's feature_names"
            )
        return table

    return table_of


def _table_parts(
    batch: Any,
    feature_to_table: Optional[Mapping[str, str]],
    tables: Optional[Collection[str]],
    unknown: Union[UnknownFeatures, str],
    want_lengths: bool,
    where: str,
) -> Tuple[Dict[str, List[Tuple[str, np.ndarray, Any]]], set]:
    """(table -> [(feature, ids, lengths or None)] in key order for the wanted tables, every table seen)."""
    table_of = _resolver(feature_to_table, unknown, where)
    seen: set = set()

    def wanted(feature: str) -> bool:
        table = table_of(feature)
        return table is not None and (tables is None or table in tables)

    parts: Dict[str, List[Tuple[str, np.ndarray, Any]]] = {}
    for feature, ids, lengths in _features(batch, wanted, want_lengths):
        table = table_of(feature)
        if table is None:
            continue
        seen.add(table)
        if tables is not None and table not in tables:
            continue
        arr = ids_array(ids, f"ids of feature {feature!r}{where}")
        parts.setdefault(table, []).append((feature, arr, lengths))
    return parts, seen


def table_ids(
    batch: Any,
    feature_to_table: Optional[Mapping[str, str]],
    tables: Optional[Collection[str]] = None,
    *,
    unknown: Union[UnknownFeatures, str] = UnknownFeatures.ERROR,
    where: str = "",
) -> Dict[str, torch.Tensor]:
    """Per table, the ids the batch looks up, its features' ids concatenated in key order.

    Args:
        batch: a KeyedJaggedTensor(-like object) or a mapping feature -> ids (or ``(ids, lengths)``).
        feature_to_table: feature -> table, or ``None`` for the identity.
        tables: the tables to return, each present (empty when no feature of the batch uses it); ``None``:
            every table some feature of the batch maps to, in the order of their first feature.
        unknown: a feature absent from ``feature_to_table`` is refused or skipped (:class:`UnknownFeatures`).
        where: appended to the feature in error messages (e.g. ``" in sample batch 3"``).

    Returns:
        table -> (n,) int64 CPU ids (in sorted table order when ``tables`` is given).

    Raises:
        ConfigError: an unknown feature with ``unknown="error"``.
        DataError: non-integer ids, a batch that is neither a mapping nor KeyedJaggedTensor-like.

    Example:
        >>> table_ids({"a": torch.tensor([1, 2]), "b": torch.tensor([7])}, {"a": "t", "b": "t"}, ["t", "u"])
        {'t': tensor([1, 2, 7]), 'u': tensor([], dtype=torch.int64)}
    """
    wanted = None if tables is None else set(tables)
    parts, _ = _table_parts(batch, feature_to_table, wanted, unknown, False, where)
    out: Dict[str, torch.Tensor] = {}
    for table in parts if wanted is None else sorted(wanted):
        got = [p[1] for p in parts.get(table, [])]
        arr = got[0] if len(got) == 1 else np.concatenate(got) if got else np.zeros(0, dtype=np.int64)
        out[table] = torch.from_numpy(arr)
    return out


def split_batch(
    batch: Any,
    tables: Sequence[str],
    feature_to_table: Optional[Mapping[str, str]],
    want_samples: bool,
    unknown: Union[UnknownFeatures, str] = UnknownFeatures.ERROR,
) -> TableIds:
    """The oracle's view of a batch: :func:`table_ids` of the planned tables, as NumPy arrays, each table
    required, with each id's sample index when annotating ranks.

    Args:
        batch: mapping feature -> ids or (ids, lengths), or a KeyedJaggedTensor-like object.
        tables: the planned tables; each must appear.
        feature_to_table: feature -> table, or ``None`` for the identity.
        want_samples: also return the sample index of each id (multi-rank annotations).
        unknown: what a feature absent from ``feature_to_table`` means (:class:`UnknownFeatures`).

    Returns:
        table -> (ids, sample index per id or None, batch size or None).

    Raises:
        ConfigError: an unknown feature (``unknown="error"``), a planned table absent from the batch.
        DataError: non-integer ids, lengths that do not sum to the number of ids.
    """
    parts, seen = _table_parts(batch, feature_to_table, set(tables), unknown, want_samples, "")
    out: TableIds = {}
    for table in tables:
        got = parts.get(table)
        if got is None:
            raise ConfigError(
                f"table {table!r} is in capacity but not in the batch (tables in the batch: {sorted(seen)}); "
                "remove it from capacity or fix feature_to_table"
            )
        pieces = [
            (arr, *_samples(feature, arr, lengths)) if want_samples else (arr, None, None)
            for feature, arr, lengths in got
        ]
        if len(pieces) == 1:
            out[table] = pieces[0]
        else:
            ids = np.concatenate([g[0] for g in pieces])
            if want_samples:
                sizes = [int(g[2] or 0) for g in pieces]
                samples = np.concatenate([g[1] for g in pieces if g[1] is not None])
                out[table] = (ids, samples, max(sizes))
            else:
                out[table] = (ids, None, None)
    return out


def _samples(feature: str, arr: np.ndarray, lengths: Any) -> Tuple[np.ndarray, int]:
    """The sample index of each of a feature's ids, and its batch size."""
    if lengths is None:
        return np.arange(arr.size, dtype=np.int64), arr.size
    lens = ids_array(lengths, f"lengths of feature {feature!r}")
    if lens.size and (lens.min() < 0 or int(lens.sum()) != arr.size):
        raise DataError(
            f"lengths of feature {feature!r} sum to {int(lens.sum())} (min {int(lens.min())}) but the "
            f"feature has {arr.size} ids; lengths must be non-negative and sum to the number of ids"
        )
    return np.repeat(np.arange(lens.size, dtype=np.int64), lens), int(lens.size)
