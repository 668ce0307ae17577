"""Private: turn one input batch into per-table id arrays (and per-id rank when annotating)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from torchrec_lookahead.errors import ConfigError, DataError

__all__: List[str] = []

# table -> (ids (N,) int64, sample index of each id (N,) int64 or None, batch size B or None)
TableIds = Dict[str, Tuple[np.ndarray, Optional[np.ndarray], Optional[int]]]


def _to_numpy(x: Any, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise DataError(f"{what} must be an integer tensor but got dtype {x.dtype}; pass LongTensor ids")
        return x.detach().to("cpu", torch.int64).contiguous().reshape(-1).numpy()
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise DataError(f"{what} must hold integers but got dtype {arr.dtype}; pass LongTensor ids")
    return np.ascontiguousarray(arr.reshape(-1), dtype=np.int64)


def _features(batch: Any, wanted: Callable[[str], bool], want_lengths: bool) -> List[Tuple[str, Any, Any]]:
    """(feature, ids, lengths or None) in key order, for a mapping or a KeyedJaggedTensor-like object.

    Every feature is listed; ``ids`` (and ``lengths`` when ``want_lengths``) may be ``None`` for a feature that is
    not ``wanted``.
    """
    if isinstance(batch, Mapping):
        out = []
        for key, value in batch.items():
            if isinstance(value, (tuple, list)):
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
        except TypeError:  # a dtype NumPy lacks (bfloat16): _to_numpy names the feature in its error
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


def split_batch(
    batch: Any,
    tables: Sequence[str],
    feature_to_table: Optional[Mapping[str, str]],
    want_samples: bool,
) -> TableIds:
    """Ids of each planned table, features sharing a table concatenated in key order.

    Args:
        batch: mapping feature -> ids or (ids, lengths), or a KeyedJaggedTensor-like object.
        tables: the planned tables; each must appear.
        feature_to_table: feature -> table, or ``None`` for the identity.
        want_samples: also return the sample index of each id (multi-rank annotations).

    Returns:
        table -> (ids, sample index per id or None, batch size or None).

    Raises:
        ConfigError: a feature absent from ``feature_to_table``, a planned table absent from the batch.
        DataError: non-integer ids, lengths that do not sum to the number of ids.
    """
    parts: Dict[str, List[Tuple[np.ndarray, Optional[np.ndarray], Optional[int]]]] = {}
    seen: set = set()
    planned = set(tables)

    def table_of(feature: str) -> str:
        if feature_to_table is None:
            return feature
        if feature in feature_to_table:
            return feature_to_table[feature]
        raise ConfigError(
            f"feature {feature!r} is not in feature_to_table (known features: {sorted(feature_to_table)}); "
            "add it to feature_to_table"
        )

    for feature, ids, lengths in _features(batch, lambda f: table_of(f) in planned, want_samples):
        table = table_of(feature)
        seen.add(table)
        if table not in planned:
            continue
        arr = _to_numpy(ids, f"ids of feature {feature!r}")
        samples: Optional[np.ndarray] = None
        size: Optional[int] = None
        if want_samples:
            if lengths is None:
                samples = np.arange(arr.size, dtype=np.int64)
                size = arr.size
            else:
                lens = _to_numpy(lengths, f"lengths of feature {feature!r}")
                if lens.size and (lens.min() < 0 or int(lens.sum()) != arr.size):
                    raise DataError(
                        f"lengths of feature {feature!r} sum to {int(lens.sum())} (min {int(lens.min())}) but the "
                        f"feature has {arr.size} ids; lengths must be non-negative and sum to the number of ids"
                    )
                samples = np.repeat(np.arange(lens.size, dtype=np.int64), lens)
                size = int(lens.size)
        parts.setdefault(table, []).append((arr, samples, size))
    out: TableIds = {}
    for table in tables:
        got = parts.get(table)
        if got is None:
            raise ConfigError(
                f"table {table!r} is in capacity but not in the batch (tables in the batch: {sorted(seen)}); "
                "remove it from capacity or fix feature_to_table"
            )
        if len(got) == 1:
            out[table] = got[0]
        else:
            ids = np.concatenate([g[0] for g in got])
            if want_samples:
                sizes = [int(g[2] or 0) for g in got]
                samples = np.concatenate([g[1] for g in got if g[1] is not None])
                out[table] = (ids, samples, max(sizes))
            else:
                out[table] = (ids, None, None)
    return out
