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
from benchmarks._uvm_traffic import (  # noqa: F401 (re-exported: gpu.py and the tests read them from here)
    cache_snapshot,
    caching_tbes,
    count_misses,
    distinct_rows,
    fbgemm_tbes,
    our_traffic,
    per_step,
    uvm_traffic,
)
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
