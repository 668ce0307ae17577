"""From a batch's KeyedJaggedTensor to per-table ids (oracle input, :func:`~torchrec_lookahead.oracle.table_ids`,
re-exported here) and back to slots (cache input).

Several features may share one table. A table's ids in a batch are the concatenation of its features' values
in KJT key order; the plan's ``slots`` follow the same order::

    kjt keys:    f_a (table t0)   f_b (table t1)   f_c (table t0)
    values:      [3, 9]           [4]              [9, 5, 1]
    ids of t0:   [3, 9, 9, 5, 1]                   (f_a then f_c)
    slots of t0: [0, 2, 2, 1, 3]  ->  remapped values [0, 2] [4] [2, 1, 3]
"""

from __future__ import annotations

from typing import Collection, Dict, Mapping

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.errors import ConfigError, DataError
from torchrec_lookahead.oracle.types import BatchPlan

__all__ = ["remap_kjt"]


def refuse_variable_batch(kjt: KeyedJaggedTensor) -> None:
    """Raise :class:`~torchrec_lookahead.errors.DataError` for a variable-batch KJT (a stride per key): the
    cache's lookups assume one batch size for every feature."""
    if kjt.variable_stride_per_key():
        raise DataError(
            "the lookahead cache does not support variable-batch KeyedJaggedTensors (variable_stride_per_key, "
            "one batch size per feature); give every feature the same batch size"
        )


def remap_kjt(
    kjt: KeyedJaggedTensor,
    plan: BatchPlan,
    feature_to_table: Mapping[str, str],
    cached_tables: Collection[str],
) -> KeyedJaggedTensor:
    """Replace the ids of cached tables' features by their cache slots from the plan.

    Args:
        kjt: the batch's sparse features (ids).
        plan: the step's plan.
        feature_to_table: feature name -> table name.
        cached_tables: tables whose features are remapped (the others keep their ids).

    Returns:
        A KJT with the same keys, lengths and weights, and slot values for cached features.

    Raises:
        ConfigError: the plan names a table that is not cached.
        DataError: a cached table used by the batch has no plan, or its plan's ``slots`` length differs from
            the number of ids the batch looks up in it.
    """
    unknown = set(plan.tables) - set(cached_tables)
    if unknown:
        raise ConfigError(
            f"plan step {plan.step} names tables {sorted(unknown)} that are not cached; cached tables: "
            f"{sorted(cached_tables)}"
        )
    refuse_variable_batch(kjt)
    values = kjt.values()
    bounds = kjt.offset_per_key()
    # a new tensor in every case: the batch's values and the plan's slots stay untouched; the cached features'
    # ranges are then overwritten with their slots (through NumPy views on the CPU: a few calls, not a
    # concatenation of every feature's piece)
    new_values = values.clone()
    host = new_values.numpy() if new_values.device.type == "cpu" and _numpy_dtype(new_values) else None
    used: Dict[str, int] = {}
    for i, key in enumerate(kjt.keys()):
        table = feature_to_table.get(key)
        if table is None or table not in cached_tables:
            continue
        lo, hi = bounds[i], bounds[i + 1]
        pos = used.get(table, 0)
        if hi > lo:
            table_plan = plan.tables.get(table)
            if table_plan is None:
                raise DataError(
                    f"batch of step {plan.step} looks up cached table '{table}' (feature '{key}') but the plan "
                    "has no entry for it; plan every cached table the batch uses"
                )
            slots = table_plan.slots
            if slots.numel() < pos + hi - lo:
                raise DataError(
                    f"plan step {plan.step} has {slots.numel()} slots for table '{table}' but the "
                    f"batch looks up more ids in it; the plan was made for another batch"
                )
            if host is not None and slots.device.type == "cpu":
                host[lo:hi] = slots.numpy()[pos : pos + hi - lo]
            else:
                new_values[lo:hi] = slots[pos : pos + hi - lo].to(new_values.device, new_values.dtype)
        used[table] = pos + hi - lo
    for table, table_plan in plan.tables.items():
        if table_plan.slots.numel() != used.get(table, 0):
            raise DataError(
                f"plan step {plan.step} has {table_plan.slots.numel()} slots for table '{table}' but the batch "
                f"looks up {used.get(table, 0)} ids in it; the plan was made for another batch"
            )
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=new_values,
        weights=kjt.weights_or_none(),
        lengths=kjt.lengths(),
        offsets=kjt.offsets(),
        stride=kjt.stride(),
        # computed here, in the planner thread, rather than again on the training thread
        length_per_key=kjt.length_per_key(),
        offset_per_key=bounds,
    )


def _numpy_dtype(t: torch.Tensor) -> bool:
    """Whether ``t``'s dtype has a NumPy view (the integer types ids come in)."""
    return t.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
