"""Checks of a cached collection: its configuration (:func:`check_configs`) and the ids and slots it is asked to
look up (:func:`check_values`)."""

from __future__ import annotations

from typing import Any, Callable, List, Mapping, Sequence

import numpy as np
import torch
from torchrec.modules.embedding_configs import DataType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead._checks import is_int
from torchrec_lookahead.errors import CapacityError, ConfigError, InvalidIdError, SetupError
from torchrec_lookahead.modules._plans import _Table
from torchrec_lookahead.modules.config import CacheOptimizerConfig
from torchrec_lookahead.store.types import EmbeddingStore

__all__ = ["check_configs", "check_values"]


def _resident_ids_in_range(
    tables: Mapping[str, _Table],
    feature_to_table: Mapping[str, str],
    kjt: KeyedJaggedTensor,
    values: torch.Tensor,
    bounds: List[int],
) -> bool:
    """Whether every id of a resident table's feature is in range, in one pass over the batch (cached
    features hold a trusted plan's slots and are skipped). On the host a per-feature min/max with NumPy's
    ``reduceat`` (single-threaded: torch's element-wise operators would run on every intra-op thread and wait
    for a core busy with the lookahead threads); on a device one pass and one host sync."""
    limits = [
        -1 if t.slot_to_id is not None else t.rows for t in (tables[feature_to_table[k]] for k in kjt.keys())
    ]
    if all(x < 0 for x in limits):  # every feature cached: nothing to check (on a device, no host sync)
        return True
    if values.device.type == "cpu":
        edges = np.asarray(bounds, dtype=np.int64)
        nonempty = np.flatnonzero(edges[1:] > edges[:-1])  # reduceat needs increasing starts
        lim = np.asarray(limits, dtype=np.int64)[nonempty]
        if not (lim >= 0).any():  # the resident tables' features are empty in this batch
            return True
        arr = values[: bounds[-1]].numpy()
        lo = np.minimum.reduceat(arr, edges[nonempty])[lim >= 0]
        hi = np.maximum.reduceat(arr, edges[nonempty])[lim >= 0]
        return bool((lo >= 0).all() and (hi < lim[lim >= 0]).all())
    sizes = torch.tensor(kjt.length_per_key(), device=values.device)
    used = values[: bounds[-1]]
    upper = torch.tensor([(1 << 62) if x < 0 else x for x in limits], device=values.device)
    upper = upper.repeat_interleave(sizes, output_size=used.numel())
    return not bool(((used < 0) | (used >= upper)).any())


def check_values(
    tables: Mapping[str, _Table],
    feature_to_table: Mapping[str, str],
    kjt: KeyedJaggedTensor,
    skip_cached: bool = False,
) -> None:
    """Refuse a batch whose ids (resident tables) or slots (cached tables) the collection cannot look up.

    Args:
        tables: the collection's tables by name.
        feature_to_table: feature -> table.
        kjt: the batch (ids of resident tables, slots of cached ones).
        skip_cached: a trusted plan's slots: the cached features are not checked.

    Raises:
        InvalidIdError: a resident table's id out of range.
        CapacityError: a cached table's slot out of range.
        SetupError: a slot that holds no row (the step's plan was not applied).
    """
    values = kjt.values()
    bounds = kjt.offset_per_key()
    if (
        skip_cached
        and values.numel()
        and _resident_ids_in_range(tables, feature_to_table, kjt, values, bounds)
    ):
        return  # the per-feature loop below only runs to name the feature of an error
    for i, key in enumerate(kjt.keys()):
        lo, hi = bounds[i], bounds[i + 1]
        if hi <= lo:
            continue
        t = tables[feature_to_table[key]]
        if skip_cached and t.slot_to_id is not None:
            continue
        seg = values[lo:hi]
        vmin, vmax = int(seg.min()), int(seg.max())
        if t.slot_to_id is None:
            if vmin < 0 or vmax >= t.rows:
                raise InvalidIdError(
                    f"feature '{key}' of table '{t.config.name}' has id {vmin if vmin < 0 else vmax} outside "
                    f"[0, {t.rows}); hash or clip ids into the table",
                    table=t.config.name,
                    id=vmin if vmin < 0 else vmax,
                    num_rows=t.rows,
                )
            continue
        if vmin < 0 or vmax >= t.rows:
            raise CapacityError(
                f"feature '{key}' of cached table '{t.config.name}' has slot {vmin if vmin < 0 else vmax} "
                f"outside [0, {t.rows}) (capacity {t.rows}); pass values remapped by the plan (remap())",
                table=t.config.name,
                needed=vmax + 1 if vmin >= 0 else None,
                available=t.rows,
            )
        if bool((t.slot_to_id.index_select(0, seg.to("cpu", torch.int64)) < 0).any()):
            raise SetupError(
                f"feature '{key}' reads an empty slot of cached table '{t.config.name}'; apply the step's "
                "plan (apply_plan) before the forward"
            )


def check_configs(
    configs: Sequence[Any],
    capacity: Mapping[str, int],
    stores: Mapping[str, EmbeddingStore],
    optimizer: CacheOptimizerConfig,
    device: torch.device,
    check_table: Callable[[Any], None],
) -> None:
    """Refuse a collection's table configs, capacities and stores that do not fit together (``check_table``:
    the collection's own rule per table, e.g. its pooling modes).

    Raises:
        ConfigError: what is wrong, naming the table.
    """
    if not configs:
        raise ConfigError("tables must list at least one table config but got none")
    names = [c.name for c in configs]
    features = [f for c in configs for f in c.feature_names]
    for kind, seen in (("table", names), ("feature", features)):
        dups = sorted({x for x in seen if seen.count(x) > 1})
        if dups:
            raise ConfigError(f"{kind} names must be unique but {dups} repeat")
    for name in list(capacity) + list(stores):
        if name not in names:
            raise ConfigError(f"unknown table '{name}' in capacity/stores; tables are {names}")
    for name in stores:
        if name not in capacity:
            raise ConfigError(f"a store was given for table '{name}' but it has no capacity (it is resident)")
    uses_fbgemm = optimizer.uses_fbgemm(device.type)
    for c in configs:
        if c.data_type != DataType.FP32:
            raise ConfigError(
                f"table '{c.name}' has data_type {c.data_type.name}; the lookahead cache trains FP32 tables only: "
                "build it with data_type FP32, or leave it out of capacity to keep it resident"
            )
        check_table(c)
        if uses_fbgemm and c.embedding_dim % 4 != 0:
            raise ConfigError(
                f"table '{c.name}' has embedding_dim {c.embedding_dim}; FBGEMM's kernel needs a multiple of 4: use "
                f"{-(-c.embedding_dim // 4) * 4}"
            )
        if c.name in capacity:
            cap = capacity[c.name]
            if not is_int(cap) or cap <= 0:
                raise ConfigError(f"capacity of table '{c.name}' must be a positive int but got {cap!r}")
        if c.name in stores:
            store = stores[c.name]
            widths = optimizer.state_widths(c.embedding_dim)
            found = (store.num_embeddings, store.embedding_dim, store.state_widths)
            if found != (c.num_embeddings, c.embedding_dim, widths):
                raise ConfigError(
                    f"store of table '{c.name}' has (num_embeddings, embedding_dim, state_widths) = {found} but "
                    f"the table needs {(c.num_embeddings, c.embedding_dim, widths)}"
                )
