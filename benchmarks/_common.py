"""Shared plumbing of the benchmark scripts: timing callbacks, loaders, launch helpers, and
the cached / resident training job of ``cache_overhead.py`` that ``memory.py``, ``scale.py`` and ``gpu.py``
reuse (``build``, ``capacities``, ``train``). Scripts import it as ``benchmarks._common`` with the repository
root on ``sys.path``; no script imports another. The helpers that need neither Lightning nor TorchRec (command
line, tables, JSON output) are in ``_report.py`` and re-exported here."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import lightning.pytorch as pl
import torch

# re-exported: the scripts import these from here or, to start without Lightning, from _report
from benchmarks._report import free_port, machine, median, parser, table, write_json  # noqa: F401
from torchrec_lookahead.data import LookaheadDataModule, WrappedDataModule
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
from torchrec_lookahead.launch import build_cli
from torchrec_lookahead.oracle import OracleConfig, min_capacity
from torchrec_lookahead.runtime import CacheStats
from torchrec_lookahead.runtime._threads import lower_thread_priority, single_threaded_ops
from torchrec_lookahead.strategies import TorchRecStrategy
from torchrec_lookahead.verify import QUIET_TRAINER_ARGS


def _run_queue_s() -> Optional[float]:
    """Seconds the calling thread has waited runnable for a CPU (Linux's per-thread ``schedstat``; else ``None``)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class StepTimer(pl.Callback):
    """Wall time of training steps after ``warmup`` steps (forward, backward, optimizer, data fetch), and where the
    training thread's time went: on the CPU, waiting for one (the run queue: other threads of this or another
    process held the cores), or neither (waiting for its data, the GIL or a lock); and the CPU of the process's
    other threads (the training step's intra-op workers, the loader threads) in the same steps."""

    def __init__(self, warmup: int = 3) -> None:
        self.warmup = warmup
        self.times: List[float] = []
        #: CPU time of the training thread in each timed step (its off-CPU time is the difference)
        self.cpu_times: List[float] = []
        #: the training thread's run-queue wait in each timed step (empty where the OS does not say)
        self.runq_times: List[float] = []
        #: CPU time of the process's other threads in each timed step
        self.other_cpu_times: List[float] = []
        self._last: Optional[float] = None
        self._last_cpu = self._last_proc = 0.0
        self._last_runq: Optional[float] = None
        self.torch_threads = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now, cpu, proc, runq = time.perf_counter(), time.thread_time(), time.process_time(), _run_queue_s()
        self.torch_threads = torch.get_num_threads()  # during training (LookaheadDataModule may lower it)
        if self._last is not None and trainer.global_step > self.warmup:
            self.times.append(now - self._last)
            self.cpu_times.append(cpu - self._last_cpu)
            self.other_cpu_times.append((proc - self._last_proc) - (cpu - self._last_cpu))
            if runq is not None and self._last_runq is not None:
                self.runq_times.append(runq - self._last_runq)
        self._last, self._last_cpu, self._last_proc, self._last_runq = now, cpu, proc, runq


def top_ops(prof: Any, cuda: bool, n: int = 15) -> Dict[str, Any]:
    """The ``n`` operators of a ``torch.profiler`` run with the most self CPU time (and, on CUDA, the most self
    device time): per operator its calls and milliseconds; and the totals."""
    events = list(prof.key_averages())

    def device_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) or 0.0)

    def row(e: Any) -> Dict[str, Any]:
        r = {
            "op": e.key,
            "calls": int(e.count),
            "self_cpu_ms": e.self_cpu_time_total / 1e3,
            "cpu_ms": e.cpu_time_total / 1e3,
        }
        if cuda:
            r["self_cuda_ms"] = device_us(e) / 1e3
        return r

    out: Dict[str, Any] = {
        "self_cpu_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
        "by_cpu": [row(e) for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:n]],
    }
    if cuda:
        out["self_cuda_ms"] = sum(device_us(e) for e in events) / 1e3
        out["by_cuda"] = [row(e) for e in sorted(events, key=lambda e: -device_us(e))[:n]]
    return out


class StepProfiler(pl.Callback):
    """``torch.profiler`` over one whole training step, from the end of step ``at - 1`` to the end of step ``at``
    (the batch's fetch, the cache's apply, forward, backward and update; CPU and, on CUDA, device time); its top
    operators in :attr:`ops` (:func:`top_ops`). A plain loop calls :meth:`start` and :meth:`stop` itself."""

    def __init__(self, at: int, device: torch.device) -> None:
        self.at, self.cuda = at, device.type == "cuda"
        self.ops: Optional[Dict[str, Any]] = None
        self._prof: Any = None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            torch.cuda.synchronize()
        self._prof = profile(activities=activities)
        self._prof.__enter__()

    def stop(self) -> None:
        if self._prof is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        self.ops, self._prof = top_ops(self._prof, self.cuda), None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at - 1:
            self.start()
        elif trainer.global_step == self.at:
            self.stop()


class StepTimeLog(StepTimer):
    """:class:`StepTimer` that also logs each timed step's wall time to the Trainer's logger as
    ``time/step_ms`` (rank 0), for runs in another process (e.g. under torchrun) read back from the logs."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        timed = len(self.times)
        super().on_train_batch_end(trainer, *args)
        if len(self.times) > timed and trainer.logger is not None and trainer.is_global_zero:
            trainer.logger.log_metrics({"time/step_ms": self.times[-1] * 1e3}, step=trainer.global_step)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "dlrm_synthetic.yaml")


def fae_settings() -> Dict[str, Any]:
    """The hot budget and calibration sample of configs/dlrm_fae.yaml (``hot_budget_bytes``,
    ``sample_fraction``), which the FAE runs of the benchmarks use."""
    import yaml

    with open(os.path.join(REPO, "configs", "dlrm_fae.yaml")) as f:
        hotcold = yaml.safe_load(f)["data"]["init_args"]["datamodule"]["init_args"]
    return {k: hotcold[k] for k in ("hot_budget_bytes", "sample_fraction")}


_QUIET = [
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.limit_val_batches=0",
    "--trainer.enable_model_summary=false",
]


def build(config: str = CONFIG, overrides: Sequence[str] = ()) -> Any:
    """A fresh model and DataModule of ``config`` (LightningCLI, not run)."""
    return build_cli(["--config", config, *_QUIET, *overrides])


def batch_size(dm: Any) -> int:
    """Samples per batch of a (possibly wrapped) synthetic DataModule."""
    inner = dm
    while isinstance(inner, WrappedDataModule):  # e.g. the lookahead around FAE's hot/cold batches
        inner = inner.datamodule
    cfg = getattr(inner, "config", None)
    return int(cfg.batch_size if cfg is not None else inner.hparams["batch_size"])


def table_rows(dm: Any) -> Dict[str, int]:
    """Table name (``t_<feature>``, as DLRMModule names them) -> rows."""
    return {f"t_{f}": int(n) for f, n in dm.num_embeddings_per_feature.items()}


def feature_tables(dm: Any) -> Dict[str, str]:
    """Feature -> table name (``t_<feature>``)."""
    return {f: f"t_{f}" for f in dm.num_embeddings_per_feature}


def oracle_floors(
    dm: Any, tables: Sequence[str], prefetch_depth: int = 1, batches: int = 0
) -> Dict[str, int]:
    """The oracle's minimum capacity of each of ``tables``: the largest number of distinct ids in a batch and the
    next ``prefetch_depth``, over the first ``batches`` training batches (all of them when 0)."""
    dm.setup("fit")
    loader = dm.train_dataloader()

    def stream() -> Any:
        for i, b in enumerate(loader):
            if batches and i >= batches:
                return
            yield b.sparse_features

    config = OracleConfig(capacity={t: 1 for t in tables}, feature_to_table=feature_tables(dm))
    return min_capacity(stream(), prefetch_depth, config)


def capacities(
    dm: Any,
    fraction: float,
    min_cached_rows: int,
    prefetch_depth: int = 1,
    batches: int = 0,
    floors: Optional[Dict[str, int]] = None,
) -> Tuple[Dict[str, int], Dict[str, int]]:
    """Capacity per cached table: ``fraction`` of its rows, bumped to the oracle's minimum where below it.

    The minimum is :func:`oracle_floors` on the first ``batches`` training batches (all of them when 0), or
    ``floors`` where given (a table -> rows map covering the cached tables, to read the batches once). Returns
    ``(capacity, bumped)``; ``bumped`` maps the tables whose capacity was raised to the rows they would have had.
    """
    rows = table_rows(dm)
    cached = {t: n for t, n in rows.items() if n > min_cached_rows}
    cap = {t: max(1, int(n * fraction)) for t, n in cached.items()}
    need = floors if floors is not None else oracle_floors(dm, list(cap), prefetch_depth, batches)
    bumped = {t: cap[t] for t in cap if cap[t] < need[t]}
    cap.update({t: need[t] for t in bumped})
    return cap, bumped


def planner_split(
    rows: Dict[str, int],
    capacity: Dict[str, int],
    sample_batches: Iterable[Dict[str, torch.Tensor]],
    embedding_dim: int,
    optimizer: str,
    horizon: int = 64,
    prefetch_depth: int = 1,
    num_sample_batches: int = 50,
) -> Any:
    """The device bytes of ``capacity`` (its rows x the cache's row bytes: weights and per-row optimizer state)
    split among its tables by the product's ``LookaheadPlanner``, as a user who sets ``device_budget_bytes``
    gets it: fetch curves on the first ``num_sample_batches`` of ``sample_batches`` (per batch, table -> ids).
    Returns the ``CachePlan``: per table its placement (``resident``: the whole table, ``capacity = rows``) and
    capacity."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from torchrec_lookahead.distributed.planner.planner import LookaheadPlanner, row_bytes
    from torchrec_lookahead.modules import CacheOptimizerConfig

    opt = CacheOptimizerConfig(optimizer)
    tables = [
        EmbeddingBagConfig(name=t, num_embeddings=rows[t], embedding_dim=embedding_dim, feature_names=[t])
        for t in capacity
    ]
    budget = sum(capacity.values()) * row_bytes(embedding_dim, opt)
    planner = LookaheadPlanner(
        budget, horizon=horizon, prefetch_depth=prefetch_depth, num_sample_batches=num_sample_batches
    )
    return planner.plan(tables, opt, sample_batches)


def train(
    cli: Any,
    capacity: Optional[Dict[str, int]],
    steps: int,
    warmup: int = 3,
    horizon: int = 64,
    prefetch_depth: int = 1,
    policy: str = "belady",
    store_dir: Optional[str] = None,
    callbacks: Sequence[pl.Callback] = (),
    accelerator: str = "cpu",
    lookahead_kwargs: Optional[Dict[str, Any]] = None,
    sharder_kwargs: Optional[Dict[str, Any]] = None,
    background_loading: bool = False,
) -> Dict[str, Any]:
    """Train ``cli``'s model for ``warmup + steps`` timed steps, resident (``capacity=None``) or cached.

    ``background_loading`` (resident only): read the training batches on a background thread, as the cached
    job's planner thread does (:class:`BackgroundLoadingDataModule`, same nice value and single-threaded
    operators), so that the two jobs differ by the cache only, not by where the batches are generated.

    Returns the per-step times (after warm-up), samples/s, the strategy and the trainer.
    """
    dm = cli.datamodule
    if isinstance(dm, LookaheadDataModule):
        dm = dm.datamodule
    if capacity is not None:
        sharders = [
            LookaheadEmbeddingBagCollectionSharder(
                capacity=capacity, store_dir=store_dir, **(sharder_kwargs or {})
            )
        ]
        dm = LookaheadDataModule(
            dm, horizon=horizon, prefetch_depth=prefetch_depth, policy=policy, **(lookahead_kwargs or {})
        )
        strategy = TorchRecStrategy(sharders=sharders, init_seed=0)
    else:
        strategy = TorchRecStrategy(init_seed=0)
        if background_loading:
            dm = BackgroundLoadingDataModule(dm, nice=int((lookahead_kwargs or {}).get("planner_nice", 19)))
    timer = StepTimer(warmup=warmup)
    window = LoaderWindow(warmup)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=strategy,
        max_steps=steps + warmup + 1,
        callbacks=[timer, window, *callbacks],
        **QUIET_TRAINER_ARGS,
    )
    pl.seed_everything(0, verbose=False)
    t0 = time.perf_counter()
    trainer.fit(cli.model, datamodule=dm)
    wall = time.perf_counter() - t0
    batch = batch_size(dm)
    step = median(timer.times)
    return {
        "times": list(timer.times),
        "cpu_times": list(timer.cpu_times),
        "runq_times": list(timer.runq_times),
        "other_cpu_times": list(timer.other_cpu_times),
        "loader": window.figures(),
        "step_ms": step * 1e3,
        "samples_per_s": batch / step,
        "fit_s": wall,
        "torch_threads": timer.torch_threads,
        "strategy": strategy,
        "trainer": trainer,
        "datamodule": dm,
    }


class LoaderWindow(pl.Callback):
    """The lookahead loader's counters over the timed steps (after ``warmup``), so that start-up (the oracle
    reading its first horizon of batches) does not count: the waits and the training thread's time in cache
    code, ms a step, and each loader thread's CPU time, ms a batch over the batches it handled in those steps
    (over every batch it handled when it handled none then: a short run's planner may have read and planned all
    its batches before the timed steps)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self._first: Optional[Tuple[int, CacheStats]] = None
        self._last: Optional[Tuple[int, CacheStats]] = None
        #: a resident job's :class:`BackgroundLoader`: (step, seconds waited for batches) at the first and last
        #: timed step
        self._waits: List[Tuple[int, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        if trainer.global_step < self.warmup:
            return
        background = getattr(datamodule, "background", None)
        if isinstance(background, BackgroundLoader):
            self._waits[1:] = []
            self._waits.append((trainer.global_step, background.wait_s))
        loader = getattr(datamodule, "loader", None)
        if loader is None:
            return
        session = trainer.strategy.cache_session() if isinstance(trainer.strategy, TorchRecStrategy) else None
        snap = (trainer.global_step, CacheStats(loader.stats()) if session is None else session.stats())
        if self._first is None:
            self._first = snap
        self._last = snap

    def figures(self) -> Dict[str, float]:
        if len(self._waits) == 2 and self._waits[1][0] > self._waits[0][0]:
            (a, wait_a), (b, wait_b) = self._waits
            return {"batch wait ms/step": (wait_b - wait_a) / (b - a) * 1e3}
        if self._first is None or self._last is None or self._last[0] == self._first[0]:
            return {}
        steps = self._last[0] - self._first[0]
        window = self._last[1] - self._first[1]
        d, total = window.threads, self._last[1].threads

        def per_batch(cpu: str, count: str) -> float:
            counts = d if getattr(d, count) > 0 else total  # the timed steps' batches, else every batch
            return getattr(counts, cpu) / max(getattr(counts, count), 1) * 1e3

        return {
            "stager wait ms/step": d.stager_wait_s / steps * 1e3,
            "batch wait ms/step": d.batch_wait_s / steps * 1e3,
            "reader cpu ms/batch": per_batch("reader_cpu_s", "read"),
            "planner cpu ms/batch": per_batch("planner_cpu_s", "planned"),
            "stager cpu ms/batch": per_batch("stager_cpu_s", "staged"),
            "training thread cache ms/step": window.training_thread_s / steps * 1e3,
        }


def cache_counters(strategy: TorchRecStrategy) -> Dict[str, int]:
    """Counters of every cached table, summed."""
    out: Dict[str, int] = {}
    for m in strategy.cached_modules():
        for st in m.cache.stats().values():
            for k, v in st.items():
                out[k] = out.get(k, 0) + int(v)
    return out


def quiet() -> None:
    """Silence the warnings and info lines that Lightning and TorchRec print for every run."""
    import logging
    import warnings

    from torchrec_lookahead._quiet import quiet_known_messages

    warnings.filterwarnings("ignore")
    quiet_known_messages()  # the log records the CLI hides too (torch's is_fx_tracing notice)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torchrec", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.argv = sys.argv[:1]  # LightningCLI(args=...) warns about unrelated command-line arguments


def proc_status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


LAUNCHER_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
)


def clean_env() -> Dict[str, str]:
    """This environment without launcher variables (a child would listen on this process's MASTER_PORT, which
    an in-process Trainer may have set), with the repository first on PYTHONPATH (children import
    ``torchrec_lookahead`` and ``benchmarks``)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    return env


def torchrun_worker(script: str, world: int, *args: str) -> Any:
    """Run ``script --worker OUT *args`` on ``world`` ranks under ``torch.distributed.run --standalone`` and
    return the JSON its rank 0 wrote to ``OUT``; the workers' stderr tail on failure."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "worker.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--standalone",
               script, "--worker", out, *args]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, env=clean_env())
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-4000:])
        with open(out) as f:
            return json.load(f)


class BackgroundLoader:
    """Iterates over ``loader`` with its batches read ahead by a background thread (at most ``depth`` waiting),
    the way the lookahead loader's planner thread reads the cached job's batches: at nice ``nice`` and with
    single-threaded torch operators. ``len()`` is the wrapped loader's; ``wait_s``: the seconds the training
    thread has waited for its batches (as the lookahead loader's ``batch_wait_s``)."""

    def __init__(self, loader: Any, depth: int = 8, nice: int = 19) -> None:
        self.loader, self.depth, self.nice = loader, depth, nice
        self.wait_s = 0.0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        items: queue.Queue[Any] = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        end = object()

        def read() -> None:
            single_threaded_ops()
            lower_thread_priority(self.nice)
            try:
                for batch in self.loader:
                    while not stop.is_set():
                        try:
                            items.put(batch, timeout=0.05)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
            except BaseException as e:  # handed to the training thread
                items.put(e)
                return
            items.put(end)

        thread = threading.Thread(target=read, daemon=True, name="benchmark-loader")
        thread.start()
        try:
            while True:
                t0 = time.perf_counter()
                item = items.get()
                self.wait_s += time.perf_counter() - t0
                if item is end:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join(timeout=30)


class BackgroundLoadingDataModule(WrappedDataModule):
    """The wrapped DataModule with its training batches read by a :class:`BackgroundLoader`."""

    def __init__(self, datamodule: pl.LightningDataModule, nice: int = 19) -> None:
        super().__init__(datamodule)
        self.nice = nice
        #: the loader of the last ``train_dataloader()`` call
        self.background: Optional[BackgroundLoader] = None

    def train_dataloader(self) -> Any:
        self.background = BackgroundLoader(self.datamodule.train_dataloader(), nice=self.nice)
        return self.background
