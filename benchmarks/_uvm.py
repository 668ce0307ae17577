"""TorchRec's own way to train tables that do not fit on the GPU, as the anchor of ``benchmarks/gpu.py``: FBGEMM's
software cache in HBM over tables in host memory (``EmbeddingComputeKernel.FUSED_UVM_CACHING``), LRU or LFU,
trained by a plain TorchRec loop (``DistributedModelParallel``, one process, a process group of one) with TorchRec's
pipelines. The model, data, embedding optimizer (row-wise Adagrad fused into FBGEMM's kernel through
``apply_optimizer_in_backward``, as the default job declares it) and dense optimizer are the config's, as in the
``cached`` run; the tables ``cached`` caches (above ``--min-cached-rows``) use ``FUSED_UVM_CACHING``, the others
TorchRec's ``FUSED`` kernel in HBM, as in ``cached``.

Runs:

* ``uvm_lru``: ``CacheParams(algorithm=LRU, prefetch_pipeline=True)`` with ``PrefetchTrainPipelineSparseDist``:
  the cache for batch i+1 is filled on a stream of its own during batch i (one batch ahead), its lines locked
  until batch i+1's backward;
* ``uvm_lfu``: ``CacheParams(algorithm=LFU)`` with ``TrainPipelineSparseDist``: FBGEMM supports the prefetch
  pipeline (cache-line locking) for LRU only (``Only LRU cache policy supports prefetch_pipeline``), and TorchRec
  logs that prefetching ahead without it gives wrong cache locations in backward; so the LFU cache is filled in
  the TBE's forward, the input distribution pipelined one batch ahead.

Same HBM bytes (:func:`byte_equal_load_factors`). The lookahead cache keeps on the GPU, per cache row, the row's
weights and its per-row optimizer state, float32: ``(D + state) x 4`` bytes (row-wise Adagrad: one float of
state, 68 B at D = 16; :func:`our_row_bytes`). FBGEMM's cache (``lxu_cache_weights``) holds weights only, ``D x
4`` bytes a row at the fp32 cache precision TorchRec gives fp32 tables (64 B; :func:`fbgemm_row_bytes`). Each
cached table's load factor is chosen so that FBGEMM's cache holds the bytes of ours::

    load_factor[t] = cache_rows[t] x our_row_bytes / (rows[t] x fbgemm_row_bytes)

(about 17/16 as many rows as ours at D = 16), capped below 1 (TorchRec's planner wants it in (0, 1)). TorchRec
puts the cached tables of one TBE in one cache of ``weighted mean load factor x their rows`` rows, that is the sum
of the per-table figures, and FBGEMM rounds it up to whole sets of 32 ways (``DEFAULT_ASSOC``;
:func:`fbgemm_cache_slots`); the run reports the rows FBGEMM allocated (``lxu_cache_weights``' rows). FBGEMM keeps
more in HBM than its cache (:func:`fbgemm_hbm_bytes`, reported, not equalised): row-wise optimizer state for
*every* row of a cached table (``construct_split_state`` places row-wise state on the device), 8 B of slot state
a slot, LRU's 8 B timestamp a slot or LFU's 8 B counter a table row, the prefetch pipeline's 4 B lock counter a
slot, and a 4 B table index a table row.

Statistics (FBGEMM's own, read at the end of the warm-up and of the last step, differences per timed step):

* ``uvm_lru``: ``uvm_cache_stats`` (``gather_uvm_cache_stats=True`` in the sharder's fused params; counted in
  the cache kernels): unique misses (rows copied host -> device into the cache, or read from host memory where a
  set had no free way: ``conflict_unique_misses``), unique and requested indices;
* ``uvm_lfu``: FBGEMM's LFU fill records no such statistics; ``record_cache_metrics.record_cache_miss_counter``
  (set on the cached TBEs after sharding) counts the unique misses with one extra cache lookup and ``unique`` per
  step (a cost the LFU run's step time carries).

Rows moved host -> device per step = unique misses (each missed row crosses the link at least once that step).
Rows moved device -> host per step (an estimate): unique misses less the growth of the cache's occupied slots
(``lxu_cache_state``): once the cache is full every inserted row evicts one, written back, and a row that found
no way is updated in host memory. Bytes = rows x ``fbgemm_row_bytes`` (FBGEMM's row-wise state stays in HBM).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
from torch import nn

from benchmarks._common import BackgroundLoader, median, table_rows
from torchrec_lookahead.modules.config import CacheOptimizerConfig

UVM_KINDS = ("uvm_lru", "uvm_lfu")
#: FBGEMM's ways per cache set on CUDA (``DEFAULT_ASSOC``; 64 on ROCm)
ASSOC = 32
#: the largest load factor TorchRec's planner takes (it wants one strictly between 0 and 1)
MAX_LOAD_FACTOR = 0.999
NEEDS_CUDA = (
    "FUSED_UVM_CACHING needs CUDA: FBGEMM keeps no cache on the CPU (TorchRec places a CPU table on the host, "
    "uncached) and TorchRec's planner refuses the kernel for a CPU topology"
)


def algorithm_of(kind: str) -> str:
    """``"lru"`` or ``"lfu"`` for a run name (``uvm_lru``, ``uvm_lfu_1pct``)."""
    for algorithm in ("lru", "lfu"):
        if kind.startswith(f"uvm_{algorithm}"):
            return algorithm
    raise ValueError(f"not a UVM run: {kind!r}; expected one of {UVM_KINDS}")


# --------------------------------------------------------------------------------------------------- byte sizes
def our_row_bytes(embedding_dim: int, optimizer: str) -> int:
    """Bytes one row of the lookahead cache takes on the GPU: weights and per-row optimizer state (float32).

    >>> our_row_bytes(16, "rowwise_adagrad"), our_row_bytes(16, "sgd"), our_row_bytes(16, "adam")
    (68, 64, 192)
    """
    widths = CacheOptimizerConfig(optimizer).state_widths(embedding_dim)
    return (embedding_dim + sum(widths.values())) * 4


def fbgemm_row_bytes(embedding_dim: int, element_size: int = 4) -> int:
    """Bytes one row of FBGEMM's cache takes (``lxu_cache_weights``: weights only, at the cache precision).

    >>> fbgemm_row_bytes(16)
    64
    """
    return embedding_dim * element_size


def byte_equal_load_factors(
    capacity: Mapping[str, int], rows: Mapping[str, int], embedding_dim: int, optimizer: str
) -> Dict[str, float]:
    """Per cached table, the FBGEMM cache load factor at which its cache holds the bytes of ours
    (``capacity[t]`` rows of :func:`our_row_bytes`), capped at :data:`MAX_LOAD_FACTOR`.

    >>> byte_equal_load_factors({"t": 1000}, {"t": 100_000}, 16, "rowwise_adagrad")
    {'t': 0.010625}
    """
    ours, theirs = our_row_bytes(embedding_dim, optimizer), fbgemm_row_bytes(embedding_dim)
    return {t: min(MAX_LOAD_FACTOR, c * ours / (rows[t] * theirs)) for t, c in capacity.items()}


def fbgemm_cache_slots(load_factors: Mapping[str, float], rows: Mapping[str, int], assoc: int = ASSOC) -> int:
    """Cache rows FBGEMM allocates for cached tables that share one TBE: TorchRec's load factor for the TBE
    (the mean of the tables' weighted by their rows, ``_get_weighted_avg_cache_load_factor``) times their rows,
    rounded up to whole sets of ``assoc`` ways (``_apply_cache_state``).

    >>> fbgemm_cache_slots({"t": 0.010625}, {"t": 100_000})  # 1,062 rows -> 34 sets of 32
    1088
    """
    weight = sum(rows[t] for t in load_factors)
    if not weight:
        return 0
    mean = sum(lf * rows[t] for t, lf in load_factors.items()) / weight
    sets = (int(weight * mean) + assoc - 1) // assoc
    return max(sets, 1) * assoc


def fbgemm_hbm_bytes(
    load_factors: Mapping[str, float],
    rows: Mapping[str, int],
    embedding_dim: int,
    optimizer: str,
    algorithm: str,
) -> Dict[str, int]:
    """HBM FBGEMM uses for the cached tables (one TBE), by buffer; ``cache_weights`` is what
    :func:`byte_equal_load_factors` equalises, the rest comes on top of it.

    >>> b = fbgemm_hbm_bytes({"t": 0.010625}, {"t": 100_000}, 16, "rowwise_adagrad", "lru")
    >>> b["cache_weights"], b["optimizer_state"], b["lxu_state"]
    (69632, 400000, 8704)
    """
    slots = fbgemm_cache_slots(load_factors, rows)
    table_rows_ = sum(rows[t] for t in load_factors)
    widths = CacheOptimizerConfig(optimizer).state_widths(embedding_dim)
    rowwise = sum(w for w in widths.values() if w == 1)  # row-wise states live in HBM, whole tables of them
    lru = algorithm == "lru"
    return {
        "cache_weights": slots * fbgemm_row_bytes(embedding_dim),
        "optimizer_state": table_rows_ * rowwise * 4,
        "slot_state": slots * 8,
        "lxu_state": slots * 8 if lru else (table_rows_ + 1) * 8,
        "locking_counter": slots * 4 if lru else 0,
        "cache_index_table_map": table_rows_ * 4,
    }


def equal_hbm_capacity(
    capacity: Mapping[str, int], rows: Mapping[str, int], embedding_dim: int, optimizer: str
) -> Dict[str, int]:
    """Our cache rows at the whole HBM FBGEMM's LRU cache of ``capacity``'s bytes uses (:func:`fbgemm_hbm_bytes`:
    its cache, index, locks and the row-wise optimizer state of every row): each table's capacity scaled by that
    total over our cache's bytes, at most its rows.

    >>> equal_hbm_capacity({"t": 1_000}, {"t": 100_000}, 16, "rowwise_adagrad")
    {'t': 13108}
    """
    lf = byte_equal_load_factors(capacity, rows, embedding_dim, optimizer)
    total = sum(fbgemm_hbm_bytes(lf, rows, embedding_dim, optimizer, "lru").values())
    scale = total / (sum(capacity.values()) * our_row_bytes(embedding_dim, optimizer))
    return {t: min(int(rows[t]), int(c * scale)) for t, c in capacity.items()}


# ------------------------------------------------------------------------------------------------ the TorchRec side
def anchor_constraints(
    tables: Sequence[str], load_factors: Mapping[str, float], algorithm: str
) -> Dict[str, Any]:
    """TorchRec planner constraints: ``FUSED_UVM_CACHING`` with the algorithm's ``CacheParams`` for the tables of
    ``load_factors``, ``FUSED`` (HBM) for the others; table-wise."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.planner import ParameterConstraints
    from torchrec.distributed.types import CacheAlgorithm, CacheParams

    lru = algorithm == "lru"
    out: Dict[str, Any] = {}
    for t in tables:
        if t in load_factors:
            params = CacheParams(
                algorithm=CacheAlgorithm.LRU if lru else CacheAlgorithm.LFU,
                load_factor=load_factors[t],
                prefetch_pipeline=lru,
            )
            out[t] = ParameterConstraints(
                sharding_types=["table_wise"],
                compute_kernels=[EmbeddingComputeKernel.FUSED_UVM_CACHING.value],
                cache_params=params,
            )
        else:
            out[t] = ParameterConstraints(
                sharding_types=["table_wise"], compute_kernels=[EmbeddingComputeKernel.FUSED.value]
            )
    return out


def anchor_sharders() -> List[Any]:
    """TorchRec's ``EmbeddingBagCollectionSharder`` with FBGEMM's UVM cache statistics on."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return [EmbeddingBagCollectionSharder(fused_params={"gather_uvm_cache_stats": True})]


def anchor_model(lm: Any, dense_device: torch.device) -> nn.Module:
    """``lm``'s DLRM with its tables on the ``meta`` device for sharding, the embedding optimizer declared as
    the LightningModule declares it (``apply_optimizer_in_backward``), wrapped in TorchRec's ``DLRMTrain``
    (``model(batch) -> (loss, (loss, logits, labels))``, as TorchRec's pipelines call it)."""
    from torchrec.models.dlrm import DLRMTrain
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from torchrec_lookahead.models.base import embedding_modules

    torch.manual_seed(0)
    model = lm.build_model(torch.device("meta"), dense_device=dense_device)
    spec = lm.embedding_optimizer
    for collection in embedding_modules(model):
        apply_optimizer_in_backward(spec.optimizer_class(), collection.parameters(), spec.optimizer_kwargs())
    return DLRMTrain(model)


def plan_anchor(model: nn.Module, constraints: Dict[str, Any], sharders: List[Any]) -> Any:
    """TorchRec's sharding plan for one CUDA device (TorchRec's planner plans for a CUDA topology on any
    machine)."""
    from torchrec_lookahead.distributed.topology import make_topology, sharding_planner

    return sharding_planner(make_topology(1, "cuda"), constraints).plan(model, sharders)


def place_plan(plan: Any, device: torch.device) -> Any:
    """``plan`` with every shard placed on ``device`` (``rank:0/<device>``): a plan made for a CUDA topology,
    used on the CPU, where TorchRec's planner refuses ``FUSED_UVM_CACHING``."""
    for module_plan in plan.plan.values():
        for p in module_plan.values():
            for shard in getattr(p.sharding_spec, "shards", None) or []:
                shard.placement = type(shard.placement)(f"rank:{shard.placement.rank()}/{device}")
    return plan


def plan_kernels(plan: Any) -> Dict[str, Dict[str, Any]]:
    """Per table of a sharding plan: compute kernel, sharding type and cache parameters."""
    out: Dict[str, Dict[str, Any]] = {}
    for module_plan in plan.plan.values():
        for name, p in module_plan.items():
            cache = p.cache_params
            algorithm = getattr(cache, "algorithm", None)
            out[name] = {
                "compute_kernel": p.compute_kernel,
                "sharding_type": p.sharding_type,
                "cache_algorithm": algorithm.name if algorithm is not None else None,
                "load_factor": cache.load_factor if cache is not None else None,
                "prefetch_pipeline": cache.prefetch_pipeline if cache is not None else None,
            }
    return out


def anchor_plan(lm: Any, dm: Any, capacity: Mapping[str, int]) -> Dict[str, Any]:
    """The byte accounting and TorchRec's plan of both UVM runs for ``capacity`` (what the CPU can check):
    row bytes, per table its rows, our cache rows and the byte-equal load factor, FBGEMM's cache rows and HBM
    bytes, and per algorithm the kernel TorchRec's planner gives each table."""
    rows = table_rows(dm)
    dim = int(lm.tables[0].embedding_dim)
    optimizer = lm.embedding_optimizer.name
    lf = byte_equal_load_factors(capacity, rows, dim, optimizer)
    names = [t.name for t in lm.tables]
    out: Dict[str, Any] = {
        "row_bytes_ours": our_row_bytes(dim, optimizer),
        "row_bytes_fbgemm": fbgemm_row_bytes(dim),
        "assoc": ASSOC,
        "tables": {
            t: {"rows": rows[t], "cache_rows_ours": c, "load_factor": lf[t]} for t, c in capacity.items()
        },
        "hbm_cache_bytes_ours": sum(capacity.values()) * our_row_bytes(dim, optimizer),
        "fbgemm_cache_slots": fbgemm_cache_slots(lf, rows),
        "fbgemm_hbm_bytes": {a: fbgemm_hbm_bytes(lf, rows, dim, optimizer, a) for a in ("lru", "lfu")},
        "kernels": {},
    }
    for algorithm in ("lru", "lfu"):
        model = anchor_model(lm, torch.device("cpu"))
        plan = plan_anchor(model, anchor_constraints(names, lf, algorithm), anchor_sharders())
        out["kernels"][algorithm] = plan_kernels(plan)
    return out


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


def caching_tbes(module: nn.Module) -> List[Any]:
    """The TBEs of :func:`fbgemm_tbes` that hold a cache (``lxu_cache_weights`` with rows; none on the CPU)."""
    return [m for m in fbgemm_tbes(module) if getattr(m, "lxu_cache_weights", torch.empty(0)).numel() > 0]


#: FBGEMM's ``UVMCacheStatsIndex``: num_calls, requested, unique indices, unique misses, conflict unique misses
_CALLS, _REQUESTED, _UNIQUE, _UNIQUE_MISSES, _CONFLICT_UNIQUE = range(5)


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


def link_bandwidth(device: torch.device, mib: int = 256, repeats: int = 5) -> Dict[str, float]:
    """Host <-> device copy bandwidth in GB/s (1e9 B/s), median of ``repeats`` copies of a pinned host buffer of
    ``mib`` MiB to the device and back (CUDA events)."""
    n = mib << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)

    def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        seconds = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        return n / median(seconds) / 1e9

    with torch.cuda.device(device):
        out = {"h2d_gb_s": timed(dev, host), "d2h_gb_s": timed(host, dev), "buffer_mib": float(mib)}
    del host, dev
    torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------------------------------- run
def ensure_process_group(device: torch.device) -> None:
    """A default process group of one (NCCL on CUDA, gloo on the CPU, as the ``torchrec`` strategy picks) unless
    one exists; Lightning's later runs in the process find and keep it."""
    import torch.distributed as dist

    from benchmarks._common import free_port

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def uvm_run(
    cli: Any,
    capacity: Mapping[str, int],
    algorithm: str,
    steps: int,
    warmup: int,
    device: torch.device,
    profiler: Optional[Any] = None,
) -> Dict[str, Any]:
    """Train ``cli``'s model with TorchRec's UVM cache (``algorithm`` ``"lru"`` or ``"lfu"``) at the HBM bytes of
    the lookahead cache of ``capacity``, ``warmup`` + ``steps`` timed steps (a synchronise at each step end), the
    batches read by a background thread as in ``resident_bg``. Returns the per-step times, samples/s, FBGEMM's
    cache rows and the traffic between the snapshots at the end of the warm-up and of the last step.

    On the CPU TorchRec places the ``FUSED_UVM_CACHING`` tables on the host without a cache, and LRU trains with
    ``TrainPipelineSparseDist`` (the prefetch pipeline needs CUDA streams): a check of the code path only, its
    traffic figures ``None``. ``profiler`` (a :class:`~benchmarks._common.StepProfiler`) profiles the last step."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.train_pipeline import PrefetchTrainPipelineSparseDist, TrainPipelineSparseDist
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from benchmarks._common import batch_size

    if algorithm not in ("lru", "lfu"):
        raise ValueError(f"algorithm must be 'lru' or 'lfu' but got {algorithm!r}")
    lm, dm = cli.model, cli.datamodule
    rows = table_rows(dm)
    dim = int(lm.tables[0].embedding_dim)
    lf = byte_equal_load_factors(capacity, rows, dim, lm.embedding_optimizer.name)
    ensure_process_group(device)
    model = anchor_model(lm, device)
    sharders = anchor_sharders()
    constraints = anchor_constraints([t.name for t in lm.tables], lf, algorithm)
    plan = plan_anchor(model, constraints, sharders)
    if device.type != "cuda":
        plan = place_plan(plan, device)
    t0 = time.perf_counter()
    dmp = DistributedModelParallel(model, device=device, sharders=sharders, plan=plan)
    shard_s = time.perf_counter() - t0
    tbes = caching_tbes(dmp)
    stats_on = all(getattr(t, "gather_uvm_cache_stats", False) for t in fbgemm_tbes(dmp))
    if algorithm == "lfu":
        count_misses(tbes)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: lm.dense_optimizer.build(ps)
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    # TorchRec's prefetch pipeline needs CUDA streams (on the CPU it prefetches nothing and its forward fails)
    prefetch = algorithm == "lru" and device.type == "cuda"
    pipeline_class = PrefetchTrainPipelineSparseDist if prefetch else TrainPipelineSparseDist
    pipeline = pipeline_class(dmp, optimizer, device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    dm.setup("fit")
    batches = iter(BackgroundLoader(dm.train_dataloader()))
    times: List[float] = []
    first: Optional[Dict[str, Any]] = None
    done = 0
    try:
        last = time.perf_counter()
        for i in range(warmup + 1 + steps):
            profiled = profiler is not None and i == warmup + steps
            if profiled:
                profiler.start()
            try:
                pipeline.progress(batches)
            except StopIteration:
                break
            sync()
            if profiled:
                profiler.stop()
            now = time.perf_counter()
            if i > warmup:
                times.append(now - last)
            elif i == warmup:  # read outside the timed steps
                first = cache_snapshot(tbes)
                now = time.perf_counter()
            last = now
            done = i + 1
    finally:
        if profiler is not None:
            profiler.stop()  # a run cut short: no profile of a step it did not finish
        batches.close()  # type: ignore[attr-defined]
    if not times or first is None:
        raise RuntimeError(
            f"{algorithm.upper()} UVM run trained {done} steps, fewer than warmup + 2 = {warmup + 2}: give the "
            "DataModule more training batches"
        )
    end = cache_snapshot(tbes)
    slots = end["slots"]
    step = median(times)
    row_bytes = (
        int(tbes[0].lxu_cache_weights.shape[1] * tbes[0].lxu_cache_weights.element_size()) if tbes else 0
    )
    out = {
        "times": times,
        "step_ms": step * 1e3,
        "samples_per_s": batch_size(dm) / step,
        "algorithm": algorithm.upper(),
        "pipeline": pipeline_class.__name__,
        "prefetch_ahead": prefetch,  # TorchRec's prefetch pipeline (the cache filled a batch ahead)
        "load_factors": lf,
        "fbgemm_cache_slots": slots,
        "fbgemm_cache_slots_planned": fbgemm_cache_slots(lf, rows),
        "hbm_cache_bytes": sum(
            int(t.lxu_cache_weights.numel() * t.lxu_cache_weights.element_size()) for t in tbes
        ),
        "stats_source": end["source"],
        "uvm_cache_stats_on": stats_on,
        "shard_s": shard_s,
        "traffic": uvm_traffic(first, end, len(times), row_bytes),
    }
    del pipeline, optimizer, dmp, tbes
    return out
