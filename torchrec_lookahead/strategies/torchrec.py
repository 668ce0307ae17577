"""``strategy="torchrec"``: Lightning training of TorchRec models under ``DistributedModelParallel``.

What this adds to Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy`:

* the LightningModule's sharded submodule (``module_name``, default ``"model"``) is wrapped in
  :class:`~torchrec.distributed.DistributedModelParallel` with the configured sharders and planner, and the
  LightningModule is *not* wrapped in DDP a second time (DMP already data-parallelises the dense part);
* the module is sharded for ``validate``/``test``/``predict`` too, not only for ``fit``;
* checkpoints are written and read with :mod:`torch.distributed.checkpoint` on every rank (a directory
  per checkpoint): Lightning's rank-0 ``torch.save`` would write other ranks' table shards empty;
* a device count that does not match the launcher (``torchrun --nproc_per_node=2`` with ``devices=1``, where
  every process would silently train alone) is refused.
"""

from __future__ import annotations

import logging
import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.model_parallel import DataParallelWrapper, get_default_sharders, get_module
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from typing_extensions import override

from torchrec_lookahead._rng import preserved_rng
from torchrec_lookahead.distributed import (
    LookaheadEmbeddingBagCollectionSharder,
    ShardedLookaheadEmbeddingBagCollection,
    check_all_sharded,
    embedding_tables,
    lookahead_sharding_plan,
    with_default_sharders,
)
from torchrec_lookahead.distributed._tables import table_configs
from torchrec_lookahead.distributed.lockstep import gather_global_kjt
from torchrec_lookahead.distributed.topology import make_topology, sharding_planner
from torchrec_lookahead.errors import CheckpointError, ConfigError, SetupError
from torchrec_lookahead.modules import CachedEmbeddingBagCollection, init_embedding_bag_tables_
from torchrec_lookahead.runtime import CacheSession, LookaheadBatch
from torchrec_lookahead.runtime._report import report_text, scan_progress
from torchrec_lookahead.runtime.adapter import as_torchrec_batch
from torchrec_lookahead.runtime.types import PinnedRowsSource
from torchrec_lookahead.store.init import init_embedding_weights
from torchrec_lookahead.strategies._ddp import DenseDataParallelWrapper
from torchrec_lookahead.strategies._signals import LockstepSignalConnector, use_lockstep_signals

__all__ = ["TorchRecStrategy"]

log = logging.getLogger(__name__)

_META_FILE = "meta.pt"
_WORLD_SIZE_KEY = "torchrec_lookahead_world_size"


# FBGEMM's fused CPU kernel implements only these optimizers (split_table_batched_embeddings_ops_training).
_CPU_FUSED_OPTIMIZERS = ("SGD", "RowWiseAdagrad", "Adagrad")


def _embedding_collections(module: nn.Module) -> List[nn.Module]:
    """TorchRec's unsharded embedding collections inside ``module`` (itself included)."""
    return [m for m in module.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]


def _check_cpu_fused_optimizers(module: nn.Module) -> None:
    for m in module.modules():
        if not isinstance(m, EmbeddingBagCollection):
            continue
        for name, p in m.named_parameters():
            for cls in getattr(p, "_optimizer_classes", []):
                if cls.__name__ not in _CPU_FUSED_OPTIMIZERS:
                    raise ConfigError(
                        f"Embedding optimizer {cls.__name__} on table parameter {name!r} is not available in "
                        f"FBGEMM's fused kernel on CPU (it supports {list(_CPU_FUSED_OPTIMIZERS)}); use one of "
                        "those, train on CUDA, or train the table through the lookahead cache, whose optimizer "
                        "runs on any device"
                    )


class _DistributedModelParallel(DistributedModelParallel):
    """TorchRec's ``DistributedModelParallel`` whose state-dict keys do not depend on whether DDP wraps its
    dense part. TorchRec's ``state_dict(prefix=p)`` strips DDP's ``module.`` and then adds ``p`` to every key;
    when nothing is left for DDP (every dense layer split across a hierarchical group) the keys already carry
    ``p``, which came twice (``model.model.*``), so such a checkpoint did not load into a run with a replicated
    layer (or into synchronous training). Loading needs no change: TorchRec's own load handles both layouts.
    """

    def state_dict(  # type: ignore[override]
        self, destination: Optional[Dict[str, Any]] = None, prefix: str = "", keep_vars: bool = False
    ) -> Dict[str, Any]:
        inner = get_module(self)
        if isinstance(inner, nn.parallel.DistributedDataParallel):
            return super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        return inner.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)  # type: ignore[no-any-return]


class TorchRecStrategy(DDPStrategy):
    """Shards a LightningModule's TorchRec model with ``DistributedModelParallel``.

    Args:
        sharders: TorchRec module sharders, added to TorchRec's default sharders (a module type none of them
            handles keeps TorchRec's default sharder; an embedding module left unsharded is refused).
        constraints: planner constraints per table name (default: every table uses ``compute_kernel``).
        compute_kernel: compute kernel asked of the planner for every table without an explicit constraint
            (``"fused"`` by default: FBGEMM's fused kernel and optimizer; ``None`` leaves it to the planner).
        sharding_types: sharding types allowed for those tables (default: table-wise and row-wise).
        module_name: attribute of the LightningModule holding the model to shard; ``None`` (default): the one
            child module of the LightningModule that holds TorchRec embedding collections
            (``EmbeddingBagCollection``, ``EmbeddingCollection``), found by walking its modules, so any
            LightningModule whose model holds such collections can be sharded, whatever its attribute names.
        plan: a precomputed sharding plan (skips the planner).
        init_seed: after sharding, write the deterministic initial values of
            :func:`~torchrec_lookahead.store.init_rows` into every resident table (the values the lookahead
            cache's stores start from), so cached and resident runs and any number of ranks start alike;
            ``None`` keeps TorchRec's random initialisation.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (``process_group_backend``,
            ``timeout``, ...).

    Example:
        >>> strategy = TorchRecStrategy(compute_kernel="fused")
        >>> strategy.shards_embeddings
        True
    """

    strategy_name = "torchrec"
    shards_embeddings = True

    def __init__(
        self,
        sharders: Optional[List[ModuleSharder]] = None,  # type: ignore[type-arg]
        constraints: Optional[Dict[str, ParameterConstraints]] = None,
        compute_kernel: Optional[str] = "fused",
        sharding_types: Optional[List[str]] = None,
        module_name: Optional[str] = None,
        plan: Optional[ShardingPlan] = None,
        init_seed: Optional[int] = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._sharders = sharders
        self._constraints = dict(constraints or {})
        self._compute_kernel = compute_kernel
        self._sharding_types = list(sharding_types or ["table_wise", "row_wise"])
        self._module_name = module_name
        self._sharded_name: Optional[str] = module_name
        self._plan = plan
        self._init_seed = init_seed
        self._session: Optional[CacheSession] = None
        self.dmp: Optional[DistributedModelParallel] = None

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``strategy="torchrec"`` (Lightning's own hook, typed as Lightning types it)."""
        strategy_registry.register(
            cls.strategy_name, cls, description="TorchRec DistributedModelParallel under Lightning"
        )

    # ----------------------------------------------------------------------------------------------- set-up
    def _check_launcher(self) -> None:
        expected = self.num_nodes * self.num_processes
        launched = os.environ.get("WORLD_SIZE")
        if launched is not None and int(launched) != expected:
            raise SetupError(
                f"The launcher started WORLD_SIZE={launched} processes but the Trainer is configured for "
                f"{self.num_processes} device(s) x {self.num_nodes} node(s) = {expected}; every process would "
                f"train alone. Set devices={int(launched) // max(self.num_nodes, 1)} (accelerator='cpu' on CPU) "
                f"and num_nodes to match torchrun's --nproc_per_node and --nnodes."
            )
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is not None and int(local) != self.num_processes:
            raise SetupError(
                f"torchrun started LOCAL_WORLD_SIZE={local} processes per node but the Trainer uses "
                f"devices={self.num_processes}; set devices={local}"
            )

    @override
    def _configure_launcher(self) -> None:
        # Checked when the Trainer is built, before any process group or launcher exists.
        self._check_launcher()
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._check_launcher()
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        if restart > 0 and agent_store and dist.is_available() and not dist.is_initialized():
            self._init_restarted_process_group(restart)
        super().setup_distributed()  # returns early once the default group exists

    def _init_restarted_process_group(self, restart: int) -> None:
        """The default process group of attempt ``restart`` of a ``torchrun --max-restarts`` job, on the agent's
        store under a prefix of its own.

        torchrun hands every attempt the same store (static rendezvous keeps one; the c10d rendezvous shares one
        server across rounds), and the workers' ``env://`` set-up uses no per-attempt prefix: a restarted rank
        can read the previous attempt's gloo addresses before its peers overwrite them and fail with "Gloo
        connectFullMesh failed ... Connection refused" or wait on a dead peer.
        """
        self.set_world_ranks()
        env = self.cluster_environment
        assert env is not None
        timeout = self._timeout or timedelta(minutes=30)
        store = dist.TCPStore(env.main_address, env.main_port, is_master=False, timeout=timeout)
        kwargs: Dict[str, Any] = {"timeout": timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        log.info("torchrun restart %d: process group on the agent's store under a prefix of its own", restart)
        dist.init_process_group(
            self._get_process_group_backend(),
            store=dist.PrefixStore(f"torchrec_lookahead/attempt_{restart}", store),
            rank=env.global_rank(),
            world_size=env.world_size(),
            **kwargs,
        )

    @override
    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")

    def _constraints_for(self, module: nn.Module) -> Dict[str, ParameterConstraints]:
        out = dict(self._constraints)
        tables = embedding_tables(module)
        unknown = sorted(set(out) - set(tables))
        if unknown:
            raise ConfigError(
                f"Planner constraints name unknown table(s) {unknown}; the model's tables are {tables}"
            )
        if self._compute_kernel is not None:
            for t in tables:
                out.setdefault(
                    t,
                    ParameterConstraints(
                        sharding_types=self._sharding_types, compute_kernels=[self._compute_kernel]
                    ),
                )
        return out

    def shard(self, module: nn.Module) -> DistributedModelParallel:
        """Wrap ``module`` in ``DistributedModelParallel`` on this rank's device (collective: every rank)."""
        if not dist.is_available() or not dist.is_initialized():
            raise SetupError("shard() needs an initialised process group; call it from the Trainer's set-up")
        if self.root_device.type == "cpu" and self._compute_kernel == "fused":
            _check_cpu_fused_optimizers(module)
        pg = dist.group.WORLD
        # the given sharders add to TorchRec's defaults: a module type none of them handles keeps its default
        sharders = (
            with_default_sharders(self._sharders) if self._sharders is not None else get_default_sharders()
        )
        plan = self._plan
        topology = make_topology(self.world_size, self.root_device.type, local_world_size=self.num_processes)
        lookahead = [s for s in sharders if isinstance(s, LookaheadEmbeddingBagCollectionSharder)]
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        for s in lookahead:
            if s.device_budget_bytes is not None and not s.capacity:
                pinning = self._pinned_rows_source()
                # the hot set is loaded or calibrated here, before the caches are sized (it is kept for training)
                hot = None if pinning is None else pinning.pinned_hot_ids()
                with scan_progress(trainer, "Lookahead cache plan: sampling batches", None) as tick:
                    plan_report = s.plan_capacity(module, self._sample_batches(tick, pinning), pinned=hot)
                report = f"Lookahead cache plan:\n{plan_report}"
                if hot:
                    report += "\nPinned hot rows in those caches (capacity = pinned + planned): " + ", ".join(
                        f"{t} {int(hot[t].numel()):,} + {c - int(hot[t].numel()):,}"
                        for t, c in sorted(s.capacity.items())
                        if t in hot
                    )
                report_text(trainer, "lookahead/cache_plan", report)
        cached: Dict[str, int] = {k: v for s in lookahead for k, v in s.capacity.items()}
        if cached:
            report_text(
                trainer,
                "lookahead/cache",
                "Lookahead cache: " + ", ".join(f"{t} {c:,} rows" for t, c in sorted(cached.items())),
            )
        for s in lookahead:
            if s.seed is None:
                s.seed = self._init_seed or 0
        if plan is None and cached:
            plan = lookahead_sharding_plan(
                module,
                sharders,
                cached,
                topology,
                constraints=self._constraints,
                compute_kernel=self._compute_kernel,
                sharding_types=self._sharding_types,
                pg=pg,
            )
        elif plan is None:
            planner = sharding_planner(topology, self._constraints_for(module))
            plan = planner.collective_plan(module, sharders, pg)
        # DistributedModelParallel replaces the collections in place: list the tables first.
        tables = [
            c
            for m in module.modules()
            if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
            for c in table_configs(m)
        ]
        dmp = _DistributedModelParallel(
            module,
            env=ShardingEnv.from_process_group(pg),  # type: ignore[arg-type]
            device=self.root_device,
            sharders=sharders,
            plan=plan,
            data_parallel_wrapper=self.data_parallel_wrapper(),
        )
        check_all_sharded(dmp)
        if self._init_seed is not None:
            # Only TorchRec's sharded collections (resident tables): the caches' stores start from the same
            # values already, and their state_dict() would flush and touch every row.
            resident = [c for c in tables if c.name not in cached]
            for m in dmp.modules():
                if isinstance(m, (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)):
                    init_embedding_bag_tables_(m, resident, seed=self._init_seed)
                elif isinstance(m, CachedEmbeddingBagCollection):  # resident tables in the cache's kernel
                    for c in m.embedding_bag_configs():
                        if c.name not in m.capacity:
                            init_embedding_weights(m.cache_weights(c.name), c.name, self._init_seed)
        return dmp

    def data_parallel_wrapper(self) -> Optional[DataParallelWrapper]:
        """How ``DistributedModelParallel`` replicates the dense (unsharded) layers: DDP over every rank, as
        TorchRec's default wrapper, with DDP's current buffer arguments (``DenseDataParallelWrapper``).
        Subclasses override it (the hierarchical strategy: DDP inside a group)."""
        return DenseDataParallelWrapper()

    def _datamodules(self) -> Tuple[Any, Any]:
        """The Trainer's DataModule and the one it wraps (the same when it wraps none)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        dm = getattr(trainer, "datamodule", None)
        return dm, getattr(dm, "datamodule", dm)

    def _pinned_rows_source(self) -> Optional[PinnedRowsSource]:
        """The wrapped DataModule when it pins rows in the caches (FAE's hot rows: a ``HotColdDataModule`` inside
        a ``LookaheadDataModule``), else ``None``."""
        from torchrec_lookahead.data.lookahead import LookaheadDataModule

        dm, inner = self._datamodules()
        if isinstance(dm, LookaheadDataModule) and isinstance(inner, PinnedRowsSource):
            return inner
        return None

    def _sample_batches(
        self, on_batch: Callable[[], None] = lambda: None, pinning: Optional[PinnedRowsSource] = None
    ) -> Iterator[Any]:
        """Training batches of the (unwrapped) DataModule, for sizing caches; identical on every rank.
        ``on_batch`` is called after each batch is read (a progress bar's tick). With ``pinning`` (the
        DataModule pins rows in the caches), its cold batches
        (:meth:`~torchrec_lookahead.runtime.types.PinnedRowsSource.cold_batches`): the dynamic caches see only
        them."""
        dm, inner = self._datamodules()
        adapter = getattr(dm, "batch_adapter", None)
        if inner is None:
            raise ConfigError(
                "The lookahead sharder has a device budget but no DataModule to sample batches from; pass a "
                "DataModule to the Trainer or give the sharder explicit capacities"
            )
        loader = inner.train_dataloader() if pinning is None else pinning.cold_batches()
        for batch in loader:
            kjt = as_torchrec_batch(batch, adapter).sparse_features
            on_batch()
            if self.world_size > 1:  # caches are planned for the global batch: gather every rank's ids
                yield gather_global_kjt(kjt, self.world_size, None)
            else:
                yield kjt

    # ---------------------------------------------------------------------------------------- the cache
    def cache_session(self) -> Optional[CacheSession]:
        """The cached job's :class:`~torchrec_lookahead.runtime.CacheSession` (built once the model is sharded;
        ``None`` before, or when the model has no cached tables): the owner of the cached training step, which
        :class:`~torchrec_lookahead.data.LookaheadDataModule` builds its loader on and :meth:`batch_to_device`
        applies every training batch through."""
        return self._session

    def cached_modules(self) -> List[ShardedLookaheadEmbeddingBagCollection]:
        """The model's collections with cached tables (the session's; none before set-up)."""
        return [] if self._session is None else list(self._session.modules)

    def flush_caches(self) -> None:
        """Write every cached row and its optimizer state back to the host stores (contract: nothing lost)."""
        if self._session is not None:
            self._session.flush()

    @override
    def batch_to_device(
        self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0
    ) -> Any:
        """Apply a training batch's cache plans (:meth:`CacheSession.apply
        <torchrec_lookahead.runtime.CacheSession.apply>`: right before the batch's training step, after the
        previous step's optimizer update, on the training thread), then move the batch (the user's own type
        when it was read through a :class:`~torchrec_lookahead.data.BatchAdapter`) to ``device``. Outside
        training (validation, prediction) no plan is applied: the batch is only moved."""
        lm = self.lightning_module
        trainer = lm._trainer if lm is not None else None
        training = trainer is not None and trainer.training
        if isinstance(batch, LookaheadBatch) and training:
            if self._session is None:
                raise SetupError("a planned batch reached a strategy whose model has no cached tables")
            self._session.apply(batch)
        if isinstance(batch, LookaheadBatch):
            batch = (
                batch.user_batch()
            )  # a batch read through a BatchAdapter goes back to the model's own type
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Agree on SIGTERM (one all-reduce of one number per step, see ``strategies/_signals.py``): when some rank
        received it, every rank ends after this step."""
        lm = self.lightning_module
        trainer = lm._trainer if lm is not None else None
        if trainer is not None and isinstance(trainer._signal_connector, LockstepSignalConnector):
            trainer._signal_connector.agree()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def on_train_end(self) -> None:
        self.flush_caches()
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        try:
            # Other ranks may be inside a collective: flush without a barrier (nobody reads afterwards).
            if self._session is not None:
                self._session.flush(barrier=False)
        finally:
            super().on_exception(exception)

    def _model_name(self, lm: pl.LightningModule) -> str:
        """The attribute of ``lm`` holding the model to shard: ``module_name``, or the one child holding TorchRec
        embedding collections (or the ``DistributedModelParallel`` built at an earlier stage)."""
        if self._module_name is not None:
            return self._module_name
        found = [
            name
            for name, child in lm.named_children()
            if isinstance(child, DistributedModelParallel) or _embedding_collections(child)
        ]
        if len(found) == 1:
            return found[0]
        if not found:
            raise ConfigError(
                f"{type(lm).__name__} holds no TorchRec embedding collection (EmbeddingBagCollection or "
                "EmbeddingCollection) in any of its modules, so strategy='torchrec' has nothing to shard and no table "
                "to cache: build the TorchRec model in configure_model() (or __init__) as an attribute of the "
                "LightningModule, or train without strategy='torchrec'"
            )
        raise ConfigError(
            f"{type(lm).__name__} holds TorchRec embedding collections under several attributes {found}; "
            "TorchRecStrategy shards one model: keep them under one nn.Module, or set "
            f"TorchRecStrategy(module_name=...) to one of {found}"
        )

    def _shard_lightning_module(self) -> None:
        lm = self.lightning_module
        if lm is None:
            raise SetupError("No LightningModule attached to the strategy")
        name = self._model_name(lm)
        self._sharded_name = name
        module = getattr(lm, name, None)
        if isinstance(module, DistributedModelParallel):
            self.dmp = module
            return
        if not isinstance(module, nn.Module):
            raise ConfigError(
                f"TorchRecStrategy(module_name={name!r}): {type(lm).__name__} has no nn.Module "
                f"attribute {name!r} (build it in configure_model()); set module_name to the "
                "attribute holding the TorchRec model, or leave it unset to find it"
            )
        if not _embedding_collections(module):
            raise ConfigError(
                f"TorchRecStrategy(module_name={name!r}): {type(lm).__name__}.{name} holds no TorchRec embedding "
                "collection (EmbeddingBagCollection or EmbeddingCollection); name the attribute that holds them, "
                "or leave module_name unset to find it"
            )
        # Sharding draws from the global random streams (TorchRec's random initial values of the tables it
        # builds, our budget planner's and FAE's passes over the data) as many times as the plan has tables,
        # cached or not: put them back, so the model's own draws (dropout) see the same stream either way.
        with preserved_rng():
            self.dmp = self.shard(module)
        setattr(lm, name, self.dmp)
        log.info("TorchRec sharding plan:\n%s", self.dmp.plan)

    def _ensure_session(self) -> None:
        lm = self.lightning_module
        if self._session is None and lm is not None:
            # Collective with several ranks (the planner's id group): every rank builds it here.
            self._session = CacheSession.for_model(lm)

    @override
    def model_to_device(self) -> None:
        lm = self.lightning_module
        if lm is None:
            return
        for name, child in lm.named_children():
            if child is not self.dmp and name != self._sharded_name:
                child.to(self.root_device)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        # Before the Trainer registers its signal handlers: SIGTERM stops every rank at the same step.
        use_lockstep_signals(trainer)
        self.accelerator.setup(trainer)
        if self.model is None:
            raise SetupError("No model attached to the strategy")
        self.precision_plugin.convert_module(self.model)
        self._shard_lightning_module()
        self._ensure_session()
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    def configure_ddp(self) -> None:
        # DistributedModelParallel already wraps the dense part in DDP; never wrap the LightningModule again.
        self._shard_lightning_module()

    @override
    def teardown(self) -> None:
        # A safety net after on_train_end's flush (or after an exception): no barrier, since another rank may
        # be gone or inside a collective.
        if self._session is not None:
            self._session.flush(barrier=False)
        lm = self.lightning_module
        unmaterialised = lm is not None and any(p.is_meta for p in lm.parameters())
        on_cpu = all(d.type == "cpu" for d in self.parallel_devices or [])
        if not unmaterialised and not on_cpu:
            super().teardown()
            return
        # Nothing to move back to the CPU, and a model that failed to shard still has meta tensors, which
        # Lightning's teardown would try (and fail) to copy.
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()

    # ------------------------------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def lightning_module_state_dict(self) -> Dict[str, Any]:
        assert self.lightning_module is not None
        return self.lightning_module.state_dict()

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        inner = getattr(optimizer, "_optimizer", optimizer)
        return inner.state_dict()

    @override
    def save_checkpoint(
        self, checkpoint: Dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("TorchRecStrategy.save_checkpoint does not take storage_options")
        path = Path(self.broadcast(str(filepath)))
        if self.is_global_zero:
            if path.is_file():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
        self.barrier("torchrec_ckpt_mkdir")
        sharded = {"state_dict": checkpoint.pop("state_dict")}
        for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
            sharded[f"optimizer_{i}"] = opt_state
        dcp.save(sharded, checkpoint_id=path)
        checkpoint[_WORLD_SIZE_KEY] = self.world_size
        if self.is_global_zero:
            torch.save(checkpoint, path / _META_FILE)
        self.barrier("torchrec_ckpt_saved")

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        meta = self._read_checkpoint_meta(path)
        lm = self.lightning_module
        assert lm is not None
        target: Dict[str, Any] = {"state_dict": lm.state_dict()}
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        for i, opt in enumerate(optimizers):
            if hasattr(opt, "init_state"):
                opt.init_state()
            target[f"optimizer_{i}"] = opt.state_dict()
        try:
            dcp.load(target, checkpoint_id=path)
        except (Exception, CheckpointException) as e:  # CheckpointException derives from BaseException
            failures = getattr(e, "failures", None) or {}
            cause = next(iter(failures.values()), e)  # a CheckpointException holds each rank's own error
            cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, traceback)
            first = (str(cause).strip().splitlines() or [""])[0]
            raise CheckpointError(
                f"checkpoint {path} could not be read ({type(cause).__name__}: {first[:300]}): its shard files are "
                "damaged or incomplete (a truncated .distcp file?), or it was written for another model or "
                "configuration; resume from an intact checkpoint of this configuration"
            ) from e
        state = target["state_dict"]
        for name, child in lm.named_children():
            prefix = f"{name}."
            sub = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            if sub:
                # DistributedModelParallel strips its wrapper prefixes only when it loads its own state.
                child.load_state_dict(sub, strict=lm.strict_loading)
        for i, opt in enumerate(optimizers):
            opt.load_state_dict(target[f"optimizer_{i}"])
        return meta

    def _read_checkpoint_meta(self, path: Path) -> Dict[str, Any]:
        """The Lightning part of the checkpoint directory ``path``, after checking that the directory is whole
        and was written by as many ranks as this run has.

        Raises:
            CheckpointError: the path does not exist, is a file (an exported checkpoint, read with
                ``strategy='auto'``), is not a checkpoint of this strategy, lacks
                torch.distributed.checkpoint's ``.metadata``, or was written by another number of ranks.
        """
        if not path.exists():
            raise CheckpointError(
                f"checkpoint {path} does not exist; check ckpt_path (under strategy='torchrec' a checkpoint is the "
                "directory ModelCheckpoint wrote, e.g. <dirpath>/epoch=0-step=100.ckpt)"
            )
        if path.is_file():
            raise CheckpointError(
                f"{path} is a checkpoint file, not a directory written by TorchRecStrategy: an ordinary checkpoint "
                "(of `export`, or of the resident model trained with strategy='auto') is read by the plain model; "
                "run with --trainer.strategy=auto (in Python, Trainer(strategy='auto')) to evaluate or serve it"
            )
        if not (path / _META_FILE).is_file():
            raise CheckpointError(
                f"{path} is not a checkpoint written by TorchRecStrategy (no {_META_FILE} inside); checkpoints of "
                "sharded models are directories written by torch.distributed.checkpoint on every rank"
            )
        if not (path / ".metadata").is_file():
            raise CheckpointError(
                f"checkpoint {path} is incomplete: torch.distributed.checkpoint's .metadata file is missing (the save "
                "was interrupted, or files were lost in a copy); resume from another checkpoint"
            )
        try:
            meta: Dict[str, Any] = torch.load(path / _META_FILE, weights_only=False)
        except Exception as e:
            raise CheckpointError(
                f"checkpoint {path}: {_META_FILE} could not be read ({type(e).__name__}); the file is damaged, "
                "resume from another checkpoint"
            ) from e
        saved = meta.pop(_WORLD_SIZE_KEY, None)
        if saved is not None and int(saved) != self.world_size:
            raise CheckpointError(
                f"checkpoint {path} was written by {saved} ranks but this run has {self.world_size}: each rank's "
                f"data position and cache state belong to a {saved}-rank job; resume it with {saved} ranks "
                f"(torchrun --nproc_per_node=... and --trainer.devices so that they make {saved}), or start a new run"
            )
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Loaded in load_checkpoint(), on every rank, from the distributed checkpoint.
        pass

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # Loaded in load_checkpoint().
        pass

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()


if TorchRecStrategy.strategy_name not in StrategyRegistry:
    TorchRecStrategy.register_strategies(StrategyRegistry)
