"""Statistics of the UVM anchor (``_uvm.py``): FBGEMM's TBE modules in a model, their cache counters before and
after a run, and the rows and bytes each side moves a step."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
from torch import nn


# ----------------------------------------------------------------------------------------------------- statistics
def fbgemm_tbes(module: nn.Module) -> List[Any]:
    """FBGEMM's TBE modules in ``module``, TorchRec's sharded collections' lookups included (they hold them in a
    plain list, which ``modules()`` does not walk)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    roots: List[nn.Module] = [module]
    for m in module.modules():
        roots += [lookup for lookup in getattr(m, "_lookups", None) or [] if isinstance(lookup, nn.Module)]
    found: Dict[int, Any] = {}
    for root in roots:
        for m in root.modules():
            if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen):
                found.setdefault(id(m), m)
    return list(found.values())


#: FBGEMM's ``UVMCacheStatsIndex``: num_calls, requested, unique indices, unique misses, conflict unique misses
_CALLS, _REQUESTED, _UNIQUE, _UNIQUE_MISSES, _CONFLICT_UNIQUE = range(5)


def caching_tbes(module: nn.Module) -> List[Any]:
    """The TBEs of :func:`fbgemm_tbes` that hold a cache (``lxu_cache_weights`` with rows; none on the CPU)."""
    return [m for m in fbgemm_tbes(module) if getattr(m, "lxu_cache_weights", torch.empty(0)).numel() > 0]


def count_misses(tbes: Sequence[Any]) -> None:
    """Turn on FBGEMM's unique-miss counter (``record_cache_metrics.record_cache_miss_counter``) of ``tbes``:
    the statistics of a cache whose fill records none (LFU)."""
    for tbe in tbes:
        metrics = getattr(tbe, "record_cache_metrics", None)
        if metrics is not None and hasattr(metrics, "_replace"):
            tbe.record_cache_metrics = metrics._replace(record_cache_miss_counter=True)


def cache_snapshot(tbes: Sequence[Any]) -> Dict[str, Any]:
    """FBGEMM's cumulative cache counters of ``tbes`` (summed), each ``None`` where the installed FBGEMM or the
    TBE's settings give none: ``unique_misses`` (from ``cache_miss_counter`` where the miss counter is on, LFU;
    else from ``uvm_cache_stats``, LRU, with ``conflict_unique_misses``, ``unique_indices``, ``requested_indices``
    and ``prefetches``: LFU's fill counts none of them), ``occupied_slots`` (``lxu_cache_state`` >= 0), ``slots``
    and ``source``, the counter read."""
    out: Dict[str, Any] = dict.fromkeys(
        ("unique_misses", "conflict_unique_misses", "unique_indices", "requested_indices", "prefetches"), None
    )
    out.update(occupied_slots=None, slots=0, source=None)

    def add(key: str, value: Optional[int]) -> None:
        if value is not None:
            out[key] = (out[key] or 0) + int(value)

    for tbe in tbes:
        out["slots"] += int(tbe.lxu_cache_weights.shape[0])
        state = getattr(tbe, "lxu_cache_state", None)
        add("occupied_slots", int((state >= 0).sum()) if isinstance(state, torch.Tensor) else None)
        metrics = getattr(tbe, "record_cache_metrics", None)
        counter = getattr(tbe, "cache_miss_counter", None)
        if getattr(metrics, "record_cache_miss_counter", False) and isinstance(counter, torch.Tensor):
            add("unique_misses", int(counter[1]))  # [forwards with a miss, unique misses]
            out["source"] = "cache_miss_counter"
        elif getattr(tbe, "gather_uvm_cache_stats", False) and hasattr(tbe, "get_uvm_cache_stats"):
            stats = tbe.get_uvm_cache_stats().tolist()
            if len(stats) > _CONFLICT_UNIQUE:
                add("unique_misses", stats[_UNIQUE_MISSES])
                add("conflict_unique_misses", stats[_CONFLICT_UNIQUE])
                add("unique_indices", stats[_UNIQUE])
                add("requested_indices", stats[_REQUESTED])
                add("prefetches", stats[_CALLS])
                out["source"] = "uvm_cache_stats"
    return out


def uvm_traffic(
    first: Mapping[str, Any], last: Mapping[str, Any], steps: int, row_bytes: int
) -> Dict[str, Any]:
    """Per-step figures of a UVM run between two :func:`cache_snapshot` s ``steps`` steps apart (totals too, to
    add runs up): rows and bytes host -> device (unique misses) and device -> host (estimated: unique misses less
    the growth of occupied slots); ``None`` where FBGEMM gave no counter.

    >>> a = {"unique_misses": 100, "occupied_slots": 50, "unique_indices": 400}
    >>> b = {"unique_misses": 300, "occupied_slots": 60, "unique_indices": 1200}
    >>> t = uvm_traffic(a, b, 2, 64)
    >>> t["rows_h2d"], t["rows_d2h"], t["bytes_h2d"], t["unique_indices"]
    (200, 190, 12800, 800)
    """

    def delta(key: str) -> Optional[int]:
        a, b = first.get(key), last.get(key)
        return None if a is None or b is None else int(b) - int(a)

    misses, grown = delta("unique_misses"), delta("occupied_slots")
    out: Dict[str, Any] = {
        "steps": steps,
        "rows_h2d": misses,
        "rows_d2h": None if misses is None or grown is None else max(0, misses - grown),
        "conflict_unique_misses": delta("conflict_unique_misses"),
        "unique_indices": delta("unique_indices"),
        "requested_indices": delta("requested_indices"),
        "row_bytes": row_bytes,
    }
    out["bytes_h2d"] = None if out["rows_h2d"] is None else out["rows_h2d"] * row_bytes
    out["bytes_d2h"] = None if out["rows_d2h"] is None else out["rows_d2h"] * row_bytes
    return out


def our_traffic(delta: Mapping[str, int], steps: int, row_bytes: int) -> Dict[str, Any]:
    """The lookahead cache's figures (the same keys as :func:`uvm_traffic`) from the difference of its counters
    over ``steps`` steps (``benchmarks._common.cache_counters``): rows fetched host -> device, written back
    device -> host, both with their optimizer state (``row_bytes``), and its lookups and hits.

    >>> our_traffic({"rows_fetched": 30, "rows_written_back": 20, "lookups": 100, "hits": 90}, 10, 68)["bytes_d2h"]
    1360
    """
    fetched, written = int(delta.get("rows_fetched", 0)), int(delta.get("rows_written_back", 0))
    return {
        "steps": steps,
        "rows_h2d": fetched,
        "rows_d2h": written,
        "bytes_h2d": fetched * row_bytes,
        "bytes_d2h": written * row_bytes,
        "lookups": int(delta.get("lookups", 0)),
        "hits": int(delta.get("hits", 0)),
        "row_bytes": row_bytes,
    }


def per_step(
    totals: Sequence[Mapping[str, Any]],
    distinct_per_step: Optional[float],
    bandwidth: Optional[Mapping[str, float]],
) -> Dict[str, Any]:
    """Per-step figures of one kind over its runs (:func:`uvm_traffic` / :func:`our_traffic` of each, added up):
    rows and bytes moved each way, the hit rate (1 - rows moved in / distinct rows a step reads from the cached
    tables, ``distinct_per_step``), and with ``bandwidth`` (:func:`link_bandwidth`) the floor the bytes imply
    (``max(bytes h2d / B_h2d, bytes d2h / B_d2h)``: the link is full duplex) in ms.

    >>> f = per_step([{"steps": 2, "rows_h2d": 10, "rows_d2h": 4, "bytes_h2d": 640, "bytes_d2h": 256}], 20.0,
    ...              {"h2d_gb_s": 1e-6, "d2h_gb_s": 1e-6})
    >>> f["rows_h2d_per_step"], f["hit_rate"], round(f["floor_ms"], 3)
    (5.0, 0.75, 320.0)
    """
    steps = sum(int(t["steps"]) for t in totals)
    out: Dict[str, Any] = {"timed_steps": steps}

    def total(key: str) -> Optional[int]:
        values = [t.get(key) for t in totals]
        return None if not values or any(v is None for v in values) else sum(int(v) for v in values)  # type: ignore

    present = totals[0].keys() if totals else ()
    for key in ("rows_h2d", "rows_d2h", "bytes_h2d", "bytes_d2h", "conflict_unique_misses", "unique_indices"):
        if key in present:
            value = total(key)
            out[f"{key}_per_step"] = None if value is None or not steps else value / steps
    lookups, hits = total("lookups"), total("hits")
    if lookups:
        out["lookup_hit_rate"] = (hits or 0) / lookups
    rows_in = out.get("rows_h2d_per_step")
    out["hit_rate"] = (
        None if rows_in is None or not distinct_per_step else max(0.0, 1.0 - rows_in / distinct_per_step)
    )
    out["floor_ms"] = None
    if bandwidth and out.get("bytes_h2d_per_step") is not None:
        d2h = out.get("bytes_d2h_per_step") or 0.0
        out["floor_ms"] = (
            max(
                out["bytes_h2d_per_step"] / (bandwidth["h2d_gb_s"] * 1e9), d2h / (bandwidth["d2h_gb_s"] * 1e9)
            )
            * 1e3
        )
    return out


def distinct_rows(dm: Any, tables: Sequence[str], batches: int) -> List[int]:
    """Per training batch of ``dm`` (the first ``batches``): the distinct ids it looks up in ``tables`` (tables
    ``t_<feature>``), summed over the tables: the rows a step needs in the cache."""
    features = [f for f in dm.num_embeddings_per_feature if f"t_{f}" in set(tables)]
    dm.setup("fit")
    out: List[int] = []
    for i, batch in enumerate(dm.train_dataloader()):
        if i >= batches:
            break
        per_feature = batch.sparse_features.to_dict()
        out.append(sum(int(torch.unique(per_feature[f].values()).numel()) for f in features))
    return out
