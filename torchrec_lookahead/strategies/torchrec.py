"""``strategy="torchrec"``: Lightning training of TorchRec models under ``DistributedModelParallel``.

What this adds to Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy`:

* the LightningModule's sharded submodule (``module_name``; by default the child module holding the embedding
  tables) is wrapped in
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
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DataParallelWrapper, get_default_sharders
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan
from typing_extensions import override

from torchrec_lookahead._checks import check_int
from torchrec_lookahead._rng import preserved_rng
from torchrec_lookahead.distributed import (
    LookaheadEmbeddingBagCollectionSharder,
    ShardedLookaheadCollection,
    check_all_sharded,
    embedding_table_configs,
    embedding_tables,
    lookahead_sharding_plan,
    with_default_sharders,
)
from torchrec_lookahead.distributed.plan import collective_plan
from torchrec_lookahead.distributed.topology import make_topology, sharding_planner
from torchrec_lookahead.errors import CheckpointError, ConfigError, SetupError
from torchrec_lookahead.modules.checkpoint_files import StoreFiles, store_files
from torchrec_lookahead.runtime import CacheSession, LookaheadBatch
from torchrec_lookahead.strategies._checkpoint import (
    checkpoint_memory_shortfall,
    collect_pieces,
    holds_weights_only,
    keep_store_files,
    load_sharded,
    load_store_files,
    read_checkpoint_meta,
    remove_checkpoint_dir,
    remove_unpublished,
    writing_path,
)
from torchrec_lookahead.strategies._checkpoint_writer import PiecesWriter, write_checkpoint
from torchrec_lookahead.strategies._ddp import DenseDataParallelWrapper
from torchrec_lookahead.strategies._rank_settings import check_ranks_agree
from torchrec_lookahead.strategies._setup_checks import check_launcher, refuse_unworkable_callbacks
from torchrec_lookahead.strategies._sharding import (
    DistributedModelParallelKeys,
    check_cached_batch_hooks,
    check_cached_precision,
    check_cpu_fused_optimizers,
    embedding_collections,
    init_resident_tables,
    model_attribute,
    seed_sharders,
    sharding_options,
)
from torchrec_lookahead.strategies._signals import (
    LockstepSignalConnector,
    announce_stop,
    use_lockstep_signals,
)
from torchrec_lookahead.strategies._sizing import size_caches

__all__ = ["TorchRecStrategy"]

log = logging.getLogger(__name__)


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
        full_checkpoint_every: a checkpoint writes each disk store's rows changed since the previous one (a
            delta over its chain of pieces, ``docs/disk_tier.md``); every this many checkpoints of a chain, or
            once the deltas hold as many bytes as the chain's full piece, it writes a full one. 1: every
            checkpoint is full.
        async_checkpoints: write the store pieces (deltas and full ones) in the background, the training thread
            stopping for the flush and their snapshots (``strategies/_checkpoint_writer.py``); the next checkpoint
            and the end of fit wait for them.
        incremental_ram_stores: checkpoints keep in-memory (``ram``, ``mmap``) stores' tables in the same chains
            (deltas of the rows written since the previous checkpoint) instead of full tensors (several ranks: with
            ``store_sharding: row_wise``).
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
        full_checkpoint_every: int = 8,
        incremental_ram_stores: bool = False,
        async_checkpoints: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_int("full_checkpoint_every", full_checkpoint_every, 1, "give 1 (every checkpoint full) or more")
        self._full_every = int(full_checkpoint_every)
        self._ram_pieces = bool(incremental_ram_stores)
        self._writer = PiecesWriter() if async_checkpoints else None
        self._sharders, self._compute_kernel, self._sharding_types = sharding_options(
            sharders, compute_kernel, sharding_types
        )
        self._constraints = dict(constraints or {})
        self._module_name = module_name
        self._sharded_name: Optional[str] = module_name
        self._plan = plan
        if init_seed is not None:
            check_int(
                "init_seed", init_seed, 0, "give a non-negative seed, or None to keep TorchRec's values"
            )
        self._init_seed = init_seed
        self._session: Optional[CacheSession] = None
        # the tables kept in files by the last checkpoint state dict, for save_checkpoint to copy
        self._store_files: Optional[StoreFiles] = None
        self.dmp: Optional[DistributedModelParallel] = None

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``strategy="torchrec"`` (Lightning's own hook, typed as Lightning types it)."""
        strategy_registry.register(
            cls.strategy_name, cls, description="TorchRec DistributedModelParallel under Lightning"
        )

    # ----------------------------------------------------------------------------------------------- set-up
    def _check_launcher(self) -> None:
        check_launcher(self.num_nodes, self.num_processes)

    @override
    def _configure_launcher(self) -> None:
        # Checked when the Trainer is built, before any process group or launcher exists.
        self._check_launcher()
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._check_launcher()
        refuse_unworkable_callbacks(getattr(self.lightning_module, "_trainer", None), type(self).__name__)
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        if restart > 0 and agent_store and dist.is_available() and not dist.is_initialized():
            self._init_restarted_process_group(restart)
        super().setup_distributed()  # returns early once the default group exists
        check_ranks_agree()  # the settings the command line gave this rank: the same on every rank

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
        pg = dist.group.WORLD
        # the given sharders add to TorchRec's defaults: a module type none of them handles keeps its default
        sharders = get_default_sharders() if self._sharders is None else with_default_sharders(self._sharders)
        plan = self._plan
        topology = make_topology(self.world_size, self.root_device.type, local_world_size=self.num_processes)
        lookahead = [s for s in sharders if isinstance(s, LookaheadEmbeddingBagCollectionSharder)]
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        cached = size_caches(lookahead, module, trainer, self.world_size)
        if self.root_device.type == "cpu" and self._compute_kernel == "fused":
            check_cpu_fused_optimizers(module, cached)  # the cache's kernel trains the cached tables
        seed_sharders(lookahead, self._init_seed)
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
            plan = collective_plan(planner, module, sharders, pg)  # its failure reaches every rank
        # DistributedModelParallel replaces the collections in place: list the tables first.
        tables = embedding_table_configs(module)
        dmp = DistributedModelParallelKeys(
            module,
            env=ShardingEnv.from_process_group(pg),  # type: ignore[arg-type]
            device=self.root_device,
            sharders=sharders,
            plan=plan,
            data_parallel_wrapper=self.data_parallel_wrapper(),
        )
        check_all_sharded(dmp)
        if self._init_seed is not None:
            init_resident_tables(dmp, [c for c in tables if c.name not in cached], self._init_seed)
        return dmp

    def data_parallel_wrapper(self) -> Optional[DataParallelWrapper]:
        """How ``DistributedModelParallel`` replicates the dense (unsharded) layers: DDP over every rank, as
        TorchRec's default wrapper, with DDP's current buffer arguments (``DenseDataParallelWrapper``).
        Subclasses override it (the hierarchical strategy: DDP inside a group)."""
        return DenseDataParallelWrapper()

    # ---------------------------------------------------------------------------------------- the cache
    def cache_session(self) -> Optional[CacheSession]:
        """The cached job's :class:`~torchrec_lookahead.runtime.CacheSession` (built once the model is sharded;
        ``None`` before, or when the model has no cached tables): the owner of the cached training step, which
        :class:`~torchrec_lookahead.data.LookaheadDataModule` builds its loader on and :meth:`batch_to_device`
        applies every training batch through."""
        return self._session

    def cached_modules(self) -> List[ShardedLookaheadCollection[Any, Any]]:
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
        when it was read through a :class:`~torchrec_lookahead.runtime.BatchAdapter`) to ``device``. Outside
        training (validation, prediction) no plan is applied: the batch is only moved."""
        lm = self.lightning_module
        trainer = lm._trainer if lm is not None else None
        training = trainer is not None and trainer.training
        if isinstance(batch, LookaheadBatch) and training:
            if self._session is None:
                raise SetupError("a planned batch reached a strategy whose model has no cached tables")
            self._session.apply(batch)
        if isinstance(batch, LookaheadBatch):
            batch = batch.user_batch()  # one read through a BatchAdapter: the model's own type again
        return super().batch_to_device(batch, device, dataloader_idx)

    def _agree_on_sigterm(self, validating: bool) -> None:
        lm = self.lightning_module
        trainer = lm._trainer if lm is not None else None
        if trainer is not None and isinstance(trainer._signal_connector, LockstepSignalConnector):
            trainer._signal_connector.agree(validating)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Agree on SIGTERM before each validation batch too: when some rank received it, every rank ends the
        validation after this batch (Lightning's evaluation loop raises ``SIGTERMException``), instead of going
        on to its end and stopping at the next training step."""
        self._agree_on_sigterm(validating=True)
        return super().validation_step(*args, **kwargs)

    @override
    def on_train_end(self) -> None:
        self.flush_caches()
        if self._writer is not None:  # the end of fit waits for the last checkpoint
            self._writer.wait()
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        announce_stop(self.lightning_module, exception)
        try:
            if self._session is not None:
                self._session.abort()
        finally:
            super().on_exception(exception)

    def _model_name(self, lm: pl.LightningModule) -> str:
        """The attribute of ``lm`` holding the model to shard (:func:`model_attribute`)."""
        return model_attribute(lm, self._module_name)

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
        if not embedding_collections(module):
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

    def _check_checkpoint_memory(self, trainer: pl.Trainer) -> None:
        """Refuse, before training, a run whose checkpoints (saved, or resumed from) cannot be held in memory:
        a checkpoint holds every cached table in full except those kept as copies of their disk store files,
        and running out of memory at the first checkpoint would lose the run. Every rank raises together."""
        if self._session is None or not (trainer.checkpoint_callbacks or trainer.ckpt_path is not None):
            return
        stores = list(self._session.target.stores.values())
        short = checkpoint_memory_shortfall(stores, processes=len(self.parallel_devices or [None]))
        if not self.reduce_boolean_decision(short is None, all=True):
            raise CheckpointError(
                short or "another rank cannot hold a checkpoint of the cached tables in memory"
            )

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
        check_cached_precision(self._sharders, self.precision_plugin, trainer.precision)
        check_cached_batch_hooks(self._sharders, self.model, trainer.state.fn)
        self.precision_plugin.convert_module(self.model)
        self._shard_lightning_module()
        self._ensure_session()
        if self._ram_pieces and self._session is not None:
            keep_store_files(list(self._session.target.stores.values()))
        self._check_checkpoint_memory(trainer)
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
        if self._writer is not None:  # after an exception: the checkpoint in writing is finished or removed
            try:
                self._writer.wait()
            except Exception as e:  # noqa: BLE001 - the run already failed; the checkpoint was removed
                log.warning("the checkpoint being written in the background failed: %s", e)
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
        # A checkpoint's state dict: tables in disk stores are copied as files by save_checkpoint, not held.
        assert self.lightning_module is not None
        with store_files() as files:
            state = self.lightning_module.state_dict()
        self._store_files = files
        return state

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
        final = Path(self.broadcast(str(filepath)))
        # written under another name and renamed once whole: a rewritten last.ckpt stays loadable meanwhile
        path = writing_path(final)
        if self._writer is not None:  # the previous checkpoint is written first
            self._writer.wait()
        if self.is_global_zero:
            remove_unpublished(final.parent)  # those of a killed process
            path.mkdir(parents=True)
        self.barrier("torchrec_ckpt_mkdir")
        self._save_own_state(path)
        files, self._store_files = self._store_files, None
        write_checkpoint(
            checkpoint, final, files, self.global_rank, self.world_size, self._full_every, self._writer
        )
        self.barrier("torchrec_ckpt_saved")
        if self.is_global_zero:
            collect_pieces(path.parent)

    def _save_own_state(self, path: Path) -> None:
        """Write what a subclass keeps beside the checkpoint's state into checkpoint ``path`` (in writing: its
        Lightning part is written after), on every rank."""

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        if self._writer is not None:
            self._writer.wait()
        path = Path(self.broadcast(str(checkpoint_path)))
        lm = self.lightning_module
        assert lm is not None
        fitting = lm._trainer is not None and lm._trainer.state.fn == TrainerFn.FITTING
        meta = read_checkpoint_meta(path, self.world_size, fitting)
        # tables in disk stores: loaded from the checkpoint's copies of their files
        with store_files() as files:
            target: Dict[str, Any] = {"state_dict": lm.state_dict()}
            # a weights-only checkpoint (refused to fit from) holds no optimizer state: validate/test/predict
            # after a fit read its weights alone
            optimizers = (
                [] if holds_weights_only(meta) else [getattr(o, "_optimizer", o) for o in self.optimizers]
            )
            for i, opt in enumerate(optimizers):
                if hasattr(opt, "init_state"):
                    opt.init_state()
                target[f"optimizer_{i}"] = opt.state_dict()
            load_sharded(target, path)
            state = target["state_dict"]
            for name, child in lm.named_children():
                prefix = f"{name}."
                sub = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
                if sub:
                    # DistributedModelParallel strips its wrapper prefixes only when it loads its own state.
                    child.load_state_dict(sub, strict=lm.strict_loading)
        if files:
            load_store_files(files, path, self.global_rank)
        for i, opt in enumerate(optimizers):
            opt.load_state_dict(target[f"optimizer_{i}"])
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
            remove_checkpoint_dir(Path(filepath))  # then the pieces no kept checkpoint's chain needs


if TorchRecStrategy.strategy_name not in StrategyRegistry:
    TorchRecStrategy.register_strategies(StrategyRegistry)
