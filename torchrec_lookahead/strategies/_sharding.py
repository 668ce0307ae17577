"""What the ``torchrec`` strategy checks and builds while sharding: its sharding options (:func:`sharding_options`),
the model to shard inside the LightningModule (:func:`model_attribute`), the optimizers FBGEMM's CPU kernel can
fuse, the precisions cached tables train with, and the ``DistributedModelParallel`` whose state-dict keys do not
depend on DDP."""

from __future__ import annotations

from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.model_parallel import get_module
from torchrec.distributed.types import ModuleSharder, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_lookahead._checks import check_choice
from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.modules import CachedCollection, init_embedding_bag_tables_
from torchrec_lookahead.store.init import init_embedding_weights

__all__ = [
    "embedding_collections",
    "check_cpu_fused_optimizers",
    "cpu_unfused_optimizer",
    "cpu_fuses",
    "check_cached_precision",
    "check_cached_batch_hooks",
    "seed_sharders",
    "sharding_options",
    "DistributedModelParallelKeys",
    "model_attribute",
]


# FBGEMM's fused CPU kernel implements only these optimizers (split_table_batched_embeddings_ops_training).
_CPU_FUSED_OPTIMIZERS = ("SGD", "RowWiseAdagrad", "Adagrad")


def embedding_collections(module: nn.Module) -> List[nn.Module]:
    """TorchRec's unsharded embedding collections inside ``module`` (itself included)."""
    return [m for m in module.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]


def cpu_fuses(optimizer: type) -> bool:
    """Whether FBGEMM's fused CPU kernel implements ``optimizer`` (a TorchRec optimizer class)."""
    return optimizer.__name__ in _CPU_FUSED_OPTIMIZERS


def cpu_unfused_optimizer(module: nn.Module, cached: Collection[str] = ()) -> Optional[Tuple[str, str]]:
    """The first (optimizer, table parameter) of ``module``'s embedding bag collections that FBGEMM's fused CPU
    kernel does not implement, among the tables not in ``cached`` (the lookahead cache's kernel trains those);
    ``None`` when there is none."""
    for m in module.modules():
        if not isinstance(m, EmbeddingBagCollection):
            continue
        for name, p in m.named_parameters():
            if name.split(".")[1:2] and name.split(".")[1] in cached:  # embedding_bags.<table>.weight
                continue
            for cls in getattr(p, "_optimizer_classes", []):
                if not cpu_fuses(cls):
                    return cls.__name__, name
    return None


def check_cpu_fused_optimizers(module: nn.Module, cached: Collection[str] = ()) -> None:
    found = cpu_unfused_optimizer(module, cached)
    if found is not None:
        raise ConfigError(
            f"Embedding optimizer {found[0]} on table parameter {found[1]!r} is not available in FBGEMM's fused "
            f"kernel on CPU (it supports {list(_CPU_FUSED_OPTIMIZERS)}); use one of those, train on CUDA, or train "
            "the table through the lookahead cache, whose optimizer runs on any device"
        )


def sharding_options(
    sharders: Optional[Sequence[ModuleSharder[nn.Module]]],
    compute_kernel: Optional[str],
    sharding_types: Optional[List[str]],
) -> Tuple[Optional[List[ModuleSharder[nn.Module]]], Optional[str], List[str]]:
    """The strategy's ``sharders`` (a list), ``compute_kernel`` and ``sharding_types`` (TorchRec's values; the
    latter table-wise and row-wise by default), checked.

    Raises:
        ConfigError: ``sharders`` is not a list, or an item of it not a TorchRec ``ModuleSharder`` (a class path
            string is a config's way of naming one: in Python pass the instance), ``sharding_types`` a single
            string, or a kernel or sharding type is not TorchRec's (the message lists TorchRec's).
    """
    if sharders is not None and not isinstance(sharders, (list, tuple)):
        raise ConfigError(
            f"sharders must be a list of sharders but got {type(sharders).__name__}; wrap it: sharders=[...]"
        )
    for i, sharder in enumerate(sharders or []):
        if not isinstance(sharder, ModuleSharder):
            raise ConfigError(
                f"sharders[{i}] must be a TorchRec ModuleSharder but got {type(sharder).__name__} {sharder!r}; "
                "pass an instance, e.g. LookaheadEmbeddingBagCollectionSharder(capacity={...})"
            )
    if isinstance(sharding_types, str):
        raise ConfigError(
            f"sharding_types must be a list but got {sharding_types!r}; e.g. [{sharding_types!r}]"
        )
    kernel = (
        None
        if compute_kernel is None
        else check_choice("compute_kernel", compute_kernel, EmbeddingComputeKernel)
    )
    types = [
        check_choice("sharding_types", t, ShardingType).value
        for t in (sharding_types or ["table_wise", "row_wise"])
    ]
    return (None if sharders is None else list(sharders)), (None if kernel is None else kernel.value), types


def check_cached_precision(
    sharders: Optional[Sequence[ModuleSharder[nn.Module]]],
    precision_plugin: Precision,
    precision: str,
) -> None:
    """Refuse a ``*-true`` precision other than 32 with cached tables, before anything is planned.

    Raises:
        ConfigError: ``precision`` is ``64-true``, ``16-true`` or ``bf16-true`` and a lookahead sharder caches
            tables: those plugins convert every batch in place, and the cache's batches carry their plan
            unchanged (a ``-mixed`` precision trains them).
    """
    if _caches(sharders) and isinstance(precision_plugin, (DoublePrecision, HalfPrecision)):
        raise ConfigError(
            f"precision={precision} converts every batch in place, which the lookahead cache's planned "
            "batches do not allow; use 32-true, or bf16-mixed / 16-mixed (which train cached tables exactly)"
        )


def check_cached_batch_hooks(
    sharders: Optional[Sequence[ModuleSharder[nn.Module]]], lm: nn.Module, fn: Optional[TrainerFn]
) -> None:
    """Refuse a LightningModule that overrides ``on_before_batch_transfer`` or ``on_after_batch_transfer`` when it
    is fitted (``fn``) and a lookahead sharder caches tables (evaluation batches are not planned: its hooks are
    the user's there; ``transfer_batch_to_device`` only moves the batch, after its plan is applied).

    Raises:
        ConfigError: such a hook: it would see (and could change) a planned batch, whose cached ids are cache
            slots by then, or replace it by one without a plan.
    """
    from torchrec_lookahead.data.wrapper import PLANNED_BATCH_HOOKS, overridden_batch_hooks

    hooks = overridden_batch_hooks(lm, pl.LightningModule, PLANNED_BATCH_HOOKS)
    if hooks and fn == TrainerFn.FITTING and _caches(sharders):
        raise ConfigError(
            f"{type(lm).__name__} overrides {hooks}: with cached tables a training batch's cached ids are cache "
            "slots when it reaches the hooks, planned steps ahead; move what the hook does into the dataset or "
            "the loader's collate_fn (or training_step, for the dense features)"
        )


def seed_sharders(sharders: Sequence[Any], init_seed: Optional[int]) -> None:
    """Give the lookahead ``sharders`` without a ``seed`` the strategy's ``init_seed`` (else 0).

    Raises:
        ConfigError: a sharder's own seed differs from ``init_seed``: the cached tables would start from other
            values than the resident ones.
    """
    for s in sharders:
        if not s.seed_given:  # a sharder reused by another strategy takes that one's seed
            s.seed = init_seed or 0
        elif init_seed is not None and s.seed != init_seed:
            raise ConfigError(
                f"the sharder's seed={s.seed} differs from the strategy's init_seed={init_seed}: the cached tables "
                "would start from other values than the resident tables and than resident training of this model; "
                "state it once, as init_seed, and drop the sharder's seed (or make the two equal)"
            )


def _caches(sharders: Optional[Sequence[ModuleSharder[nn.Module]]]) -> bool:
    """Whether a lookahead sharder of ``sharders`` caches tables."""
    from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder

    return any(
        isinstance(s, LookaheadEmbeddingBagCollectionSharder)
        and (s.capacity or s.device_budget_bytes is not None)
        for s in sharders or []
    )


class DistributedModelParallelKeys(DistributedModelParallel):
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


def model_attribute(lm: pl.LightningModule, module_name: Optional[str]) -> str:
    """The attribute of ``lm`` holding the model to shard: ``module_name``, or the one child holding TorchRec
    embedding collections (or the ``DistributedModelParallel`` built at an earlier stage)."""
    if module_name is not None:
        return module_name
    found = [
        name
        for name, child in lm.named_children()
        if isinstance(child, DistributedModelParallel) or embedding_collections(child)
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


def init_resident_tables(dmp: nn.Module, resident: List[Any], seed: int) -> None:
    """Write the stores' deterministic initial values (:func:`~torchrec_lookahead.store.init_rows`) into the
    ``resident`` tables of ``dmp``: TorchRec's sharded collections, and resident tables trained in a cache's
    kernel. Not the cached tables: their stores start from those values already, and a cache's state_dict()
    would flush and touch every row."""
    for m in dmp.modules():
        if isinstance(m, (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)):
            init_embedding_bag_tables_(m, resident, seed=seed)
        elif isinstance(m, CachedCollection):  # resident tables in the cache's kernel
            for c in m.table_configs():
                if c.name not in m.capacity:
                    init_embedding_weights(m.cache_weights(c.name), c.name, seed)
