"""CachedCollection: what a cached embedding collection is, whatever its output (pooled bags or per-id rows).

Each cached table keeps ``capacity`` rows on the device (the cache), addressed by slot; its full rows and
their optimizer state live in an :class:`~torchrec_lookahead.store.EmbeddingStore`. A
:class:`~torchrec_lookahead.oracle.types.BatchPlan` moves rows before each step::

    apply_plan(plan_t):   evict_slots -> store.scatter(evict_ids)      (weights + optimizer state)
                          store.gather(fetch_ids) -> fetch_slots        (or pre-gathered StagedRows)
    forward(remap(kjt_t, plan_t))                                       (values of cached features = slots)
    loss.backward()                                                     (fused optimizer updates cached rows)

Tables without a capacity are resident: all their rows stay on the device. Lookups and the fused sparse
optimizer run in FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``, the kernel behind TorchRec's FUSED
compute kernel, or in a PyTorch kernel with FBGEMM's formulas where FBGEMM has no kernel for the optimizer on
the device (Adam on CPU). Because the optimizer is row-sparse and a row's state travels with the row, the
result equals resident training exactly.

:class:`CachedCollection` holds all of that: slots, stores, plans, staging, checks, statistics and checkpoints.
Its two kinds are siblings that differ only in the kernels' pooling and the output of ``forward``:
:class:`~torchrec_lookahead.modules.CachedEmbeddingBagCollection` (a ``KeyedTensor`` of pooled bags) and
:class:`~torchrec_lookahead.modules.CachedEmbeddingCollection` (a dict of ``JaggedTensor`` s of per-id rows).

The fused weights are deliberately not ``nn.Parameter`` s of this module (TorchRec's convention for fused
tables): a dense optimizer must not see them. ``state_dict()`` flushes the cache and exposes full tables as
``<collection>.<table>.weight`` plus ``<collection>.<table>.<state>`` and ``optimizer_step``, where
``<collection>`` is TorchRec's attribute for the kind (``embedding_bags`` or ``embeddings``).
"""

from __future__ import annotations

import abc
import numbers
from dataclasses import dataclass
from typing import (
    Any,
    ClassVar,
    Dict,
    Generic,
    List,
    Mapping,
    Optional,
    Self,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)

import numpy as np
import torch
from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead._checks import check_choice, is_int
from torchrec_lookahead.errors import ConfigError, DataError, SetupError
from torchrec_lookahead.modules._kernels import _CacheKernel, make_kernel
from torchrec_lookahead.modules._moves import (
    PreparedPlan,
    WriteBacks,
    Writes,
    check_prepared_staged,
    counted,
    flush_rows,
    move,
    prepare,
)
from torchrec_lookahead.modules._plans import (
    COUNTERS,
    AppliedPlan,
    CheckedPlan,
    _Table,
    cached_table,
    check_shared_slots,
    validate_plan,
)
from torchrec_lookahead.modules._spaces import SlotSpaceViews, kernel_tables, slot_spaces
from torchrec_lookahead.modules._values import check_configs, check_values
from torchrec_lookahead.modules.checkpoint_files import load_tables, save_tables
from torchrec_lookahead.modules.config import CacheLayout, CacheOptimizerConfig
from torchrec_lookahead.modules.remap import refuse_variable_batch, remap_kjt
from torchrec_lookahead.modules.staging import stage_rows
from torchrec_lookahead.modules.types import StagedRows
from torchrec_lookahead.oracle.batch_ids import UnknownFeatures, table_ids
from torchrec_lookahead.oracle.types import BatchPlan
from torchrec_lookahead.store import EmbeddingStore, TensorStore, init_embedding_weights

__all__ = ["CachedCollection", "KernelGroup"]

#: a collection's table config: ``EmbeddingBagConfig`` (pooled) or ``EmbeddingConfig`` (unpooled); covariant, so
#: that code taking any cached collection says ``CachedCollection[BaseEmbeddingConfig, object]``
_ConfigT = TypeVar("_ConfigT", bound=BaseEmbeddingConfig, covariant=True)
#: a collection's output: ``KeyedTensor`` (pooled) or ``Dict[str, JaggedTensor]`` (unpooled)
_OutT = TypeVar("_OutT", covariant=True)


@dataclass(frozen=True)
class KernelGroup:
    """One kernel of a cached collection and what it holds: the tables sharing its pooling and dimension rule.

    Attributes:
        kernel: the lookup kernel (FBGEMM's TBE or the PyTorch one); its ``set_backward_hook`` hands its
            backward elsewhere (the multi-rank exact exchange).
        tables: the kernel's tables, in its order.
        features: the kernel's features, in its order (``kernel.feature_table_map`` indexes ``tables``).
    """

    kernel: _CacheKernel
    tables: Tuple[str, ...]
    features: Tuple[str, ...]


class CachedCollection(SlotSpaceViews, nn.Module, abc.ABC, Generic[_ConfigT, _OutT]):
    """A TorchRec embedding collection with a bounded device cache per large table, exactly equal to resident
    training: everything but the output, which each kind's :meth:`forward` makes of :meth:`_lookups`.

    A kind sets :attr:`_COLLECTION` and implements :meth:`_kernel_group` (which kernel a table joins),
    :meth:`_check_table` (the table configs it refuses) and :meth:`forward`.

    Args:
        tables: table configs of the kind (float32).
        capacity: table name -> cache rows; tables absent are resident (full size on the device, no store).
        optimizer: the fused sparse optimizer (default row-wise Adagrad, lr 0.01).
        stores: table name -> store for cached tables; default a :class:`TensorStore` per cached table.
        seed: seed of the initial values (:func:`~torchrec_lookahead.store.init_rows`), for stores created
            here and for resident tables.
        device: device of the cache (default CPU).
        is_weighted: whether features carry per-id weights (``kjt.weights()``).
        cache_layout: ``"pooled"`` (default): the cached tables of one kernel and dimension share one cache of
            the sum of their capacities (:attr:`slot_spaces`), planned jointly; ``"per_table"``: each keeps its
            own ``capacity`` rows (:class:`~torchrec_lookahead.modules.CacheLayout`).

    Raises:
        ConfigError: an unknown table in ``capacity`` or ``stores``, a duplicate name, a non-positive capacity,
            an unsupported data type, a table the kind refuses, a dimension FBGEMM cannot handle, or a store
            whose shape or optimizer-state layout differs from the table's.
    """

    def __init__(
        self,
        tables: Sequence[_ConfigT],
        capacity: Mapping[str, int],
        optimizer: Optional[CacheOptimizerConfig] = None,
        stores: Optional[Mapping[str, EmbeddingStore]] = None,
        seed: int = 0,
        device: Optional[torch.device] = None,
        is_weighted: bool = False,
        cache_layout: Union[CacheLayout, str] = CacheLayout.POOLED,
    ) -> None:
        super().__init__()
        self._layout = check_choice("cache_layout", cache_layout, CacheLayout)
        self._optimizer_config = optimizer if optimizer is not None else CacheOptimizerConfig()
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._seed = int(seed)
        self._is_weighted = bool(is_weighted)
        self._configs: List[_ConfigT] = list(tables)
        stores = dict(stores or {})
        check_configs(
            self._configs, capacity, stores, self._optimizer_config, self._device, self._check_table
        )
        self._tables: Dict[str, _Table] = {}
        self._applied: Optional[AppliedPlan] = None  # the plan the next forward covers (see apply_plan)
        self.consumed_step: Optional[int] = None  #: the last plan's step a forward covered (None: none yet)
        self._feature_names: List[str] = []
        self._feature_to_table: Dict[str, str] = {}
        for cfg in self._configs:
            for feature in cfg.feature_names:
                self._feature_names.append(feature)
                self._feature_to_table[feature] = cfg.name
        groups = self._kernel_groups(self._configs)
        self._kernels: List[_CacheKernel] = []
        self._group_features: List[List[str]] = []
        self._capacity = {str(n): int(c) for n, c in capacity.items()}
        self._spaces = slot_spaces(groups.values(), self._capacity, self._layout)
        for g, ((mode, _), cfgs) in enumerate(groups.items()):
            # one kernel table per table (FBGEMM's CPU kernels sum a table's gradients differently when features
            # of two tables share one); the tables of a slot space share its rows' storage (``shares``)
            rows, shares, spaces = kernel_tables(cfgs, self._capacity, self._layout)
            self._group_features.append([f for c in cfgs for f in c.feature_names])
            kernel = make_kernel(
                rows,
                [c.embedding_dim for c in cfgs],
                [i for i, c in enumerate(cfgs) for _ in c.feature_names],
                mode,
                self._optimizer_config,
                self._device,
                table_names=[c.name for c in cfgs],
                shares=shares,
            )
            self._kernels.append(kernel)
            for i, c in enumerate(cfgs):
                store: Optional[EmbeddingStore] = None
                slot_to_id: Optional[torch.Tensor] = None
                if c.name in capacity:
                    store = stores.get(c.name) or TensorStore(
                        c.num_embeddings,
                        c.embedding_dim,
                        self._optimizer_config.state_widths(c.embedding_dim),
                        name=c.name,
                        seed=self._seed,
                    )
                    slot_to_id = torch.full((rows[i],), -1, dtype=torch.int64)
                    kernel.weights(i).zero_()
                else:
                    init_embedding_weights(kernel.weights(i), c.name, self._seed)
                self._tables[c.name] = _Table(c, g, i, rows[i], store, slot_to_id, spaces[i])
        self._cached = [n for n, t in self._tables.items() if t.cached]
        #: per cached table (``_cached``'s order), its counters (``COUNTERS``): applied plans' and flushes'
        self._counts = np.zeros((len(self._cached), len(COUNTERS)), dtype=np.int64)
        #: evicted rows whose store writes the stager thread lands (``apply_plan(defer_write_backs=True)``)
        self._write_backs = WriteBacks()
        #: what a write-back or flush that names no rows writes: every row, none once :meth:`share_stores`
        self._unnamed: Writes = None
        #: the kernels' outputs, one after another, are in feature order; and each feature's dimension
        self._output_order_matches = [f for fs in self._group_features for f in fs] == self._feature_names
        self._dims = [
            self._tables[self._feature_to_table[f]].config.embedding_dim for f in self._feature_names
        ]

    _COLLECTION: ClassVar[str]
    """The kind's collection attribute in TorchRec (``embedding_bags``, ``embeddings``): the state dict's keys."""

    @abc.abstractmethod
    def _check_table(self, cfg: Any) -> None:
        """Refuse a table config the kind's kernels cannot train (raise :class:`ConfigError`)."""

    @abc.abstractmethod
    def forward(self, features: KeyedJaggedTensor) -> _OutT:
        """The kind's output for every feature; cached features' values must already be slots
        (:meth:`remap`)."""

    # ------------------------------------------------------------------------------------------------------
    # introspection
    # ------------------------------------------------------------------------------------------------------
    def table_configs(self) -> List[_ConfigT]:
        """The table configs, in order (``embedding_bag_configs()`` / ``embedding_configs()`` of the kind)."""
        return list(self._configs)

    @property
    def optimizer_config(self) -> CacheOptimizerConfig:
        """The fused sparse optimizer."""
        return self._optimizer_config

    @property
    def learning_rate(self) -> float:
        """The sparse optimizer's current learning rate (``optimizer.learning_rate`` until changed, as float32).

        Example:
            >>> from torchrec import EmbeddingBagConfig
            >>> from torchrec_lookahead.modules import CachedEmbeddingBagCollection
            >>> ebc = CachedEmbeddingBagCollection(
            ...     [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=100, feature_names=["f"])],
            ...     {"t": 10}, CacheOptimizerConfig("exact_sgd", learning_rate=0.5))
            >>> ebc.set_learning_rate(0.25)
            >>> ebc.learning_rate
            0.25
        """
        if not self._kernels:
            return float(torch.tensor(self._optimizer_config.learning_rate, dtype=torch.float32))
        return self._kernels[0].get_learning_rate()

    def set_learning_rate(self, lr: float) -> None:
        """Set the learning rate of the next updates of every table (cached, and resident ones trained here), as
        TorchRec's fused optimizer sets its kernel's from its parameter group; a scheduler reaches it through
        the sharded module's ``fused_optimizer``.

        Raises:
            ConfigError: ``lr`` is not a finite number >= 0.
        """
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:
            lr = float(lr)
        if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not 0.0 <= float(lr) < float("inf"):
            raise ConfigError(f"Expected a finite learning rate >= 0 but got {lr!r}")
        for kernel in self._kernels:
            kernel.set_learning_rate(float(lr))

    @property
    def optimizer_step(self) -> int:
        """The sparse optimizer's iteration counter (Adam's bias correction)."""
        return self._kernels[0].get_step() if self._kernels else 0

    def set_optimizer_step(self, step: int) -> None:
        """Set the sparse optimizer's iteration counter of every kernel.

        Raises:
            ConfigError: ``step`` is not a non-negative integer.
        """
        if not is_int(step) or step < 0:
            raise ConfigError(f"Expected a non-negative integer optimizer step but got {step!r}")
        for kernel in self._kernels:
            kernel.set_step(int(step))

    @property
    def device(self) -> torch.device:
        """Device of the cache."""
        return self._device

    @property
    def feature_names(self) -> List[str]:
        """Features in output order (tables in config order, each table's features in order)."""
        return list(self._feature_names)

    @property
    def feature_to_table(self) -> Dict[str, str]:
        """Feature name -> table name."""
        return dict(self._feature_to_table)

    @property
    def stores(self) -> Dict[str, EmbeddingStore]:
        """Cached table name -> store."""
        return {n: t.store for n, t in self._tables.items() if t.store is not None}

    def slot_ids(self, table: str) -> torch.Tensor:
        """(cache_rows,) id of this table held by each slot of its cache, -1 for a slot it does not hold (a copy).

        Raises:
            ConfigError: the table is unknown or resident.
        """
        t = self._table(table)
        if t.slot_to_id is None:
            raise ConfigError(f"table '{table}' is resident; it has no slots")
        return t.slot_to_id.clone()

    def kernel_groups(self) -> List[KernelGroup]:
        """The collection's kernels with their tables and features, in kernel order."""
        out = []
        for g, kernel in enumerate(self._kernels):
            tables = sorted((t.local, n) for n, t in self._tables.items() if t.group == g)
            out.append(KernelGroup(kernel, tuple(n for _, n in tables), tuple(self._group_features[g])))
        return out

    def cache_weights(self, table: str) -> torch.Tensor:
        """(rows, D) view of a table's device rows (cache slots, or the full table when resident)."""
        t = self._table(table)
        return self._kernels[t.group].weights(t.local)

    def cache_states(self, table: str) -> Dict[str, torch.Tensor]:
        """Per optimizer state name, the (rows, w) view of a table's device state."""
        t = self._table(table)
        return self._kernels[t.group].states(t.local)

    def train(self, mode: bool = True) -> Self:
        """Set training mode on this module and on the kernels it owns."""
        super().train(mode)
        for kernel in self._kernels:
            kernel.train(mode)
        return self

    # ------------------------------------------------------------------------------------------------------
    # batches
    # ------------------------------------------------------------------------------------------------------
    def table_ids(self, kjt: KeyedJaggedTensor) -> Dict[str, torch.Tensor]:
        """Per cached table, the ids the batch looks up (the oracle's input), in KJT key order.

        Args:
            kjt: the batch's sparse features (ids).

        Returns:
            cached table name -> (n,) int64 ids.
        """
        cached = [n for n, t in self._tables.items() if t.cached]
        return table_ids(kjt, self._feature_to_table, cached, unknown=UnknownFeatures.IGNORE)

    def remap(self, kjt: KeyedJaggedTensor, plan: BatchPlan) -> KeyedJaggedTensor:
        """Replace the ids of cached features by their slots (see :func:`~.remap.remap_kjt`)."""
        return remap_kjt(kjt, plan, self._feature_to_table, [n for n, t in self._tables.items() if t.cached])

    def _lookups(self, features: KeyedJaggedTensor) -> List[Tuple[KeyedJaggedTensor, torch.Tensor]]:
        """Per kernel, the batch's features of its tables (in the kernel's order) and the kernel's output.

        Args:
            features: KJT with every feature of the collection (extra keys are ignored); values of cached
                tables' features are cache slots (:meth:`remap`), the others ids.

        Raises:
            DataError: a feature is missing, or weights are missing for a weighted collection.
            InvalidIdError: an id of a resident table is out of range.
            CapacityError: a slot is not below its table's capacity.
            SetupError: a slot is empty (no ``apply_plan`` loaded a row into it).
        """
        refuse_variable_batch(features)
        keys = features.keys()
        missing = [f for f in self._feature_names if f not in keys]
        if missing:
            raise DataError(f"features {missing} are missing from the batch (it has {keys})")
        if self._is_weighted and features.weights_or_none() is None:
            raise DataError("the collection is weighted (is_weighted=True) but the batch carries no weights")
        applied = self.consume_applied_plan()
        trusted = applied is not None and applied.skips_slot_checks
        outputs: List[Tuple[KeyedJaggedTensor, torch.Tensor]] = []
        for g, kernel in enumerate(self._kernels):
            names = self._group_features[g]
            kjt = features if list(keys) == names else features.permute([keys.index(f) for f in names])
            check_values(self._tables, self._feature_to_table, kjt, skip_cached=trusted)
            weights = kjt.weights().float() if self._is_weighted else None
            out = kernel.lookup(
                kjt.values().to(self._device, torch.int64),
                kjt.offsets().to(self._device, torch.int64),
                weights,
            )
            outputs.append((kjt, out))
        return outputs

    # ------------------------------------------------------------------------------------------------------
    # plans
    # ------------------------------------------------------------------------------------------------------
    def stage(self, plan: BatchPlan, pin_memory: bool = False) -> StagedRows:
        """Gather the rows ``plan`` fetches from the stores (see :func:`~.staging.stage_rows`), every slot space's
        as one, once the write-backs of the plans applied before it have landed."""
        self.land_write_backs()
        return stage_rows(plan, self.stores, pin_memory=pin_memory, spaces=self._spaces)

    def land_write_backs(self) -> None:
        """Write to the stores the evicted rows whose writes were left to another thread (see :meth:`apply_plan`'s
        ``defer_write_backs``); what reads a store calls it first."""
        self._write_backs.land()

    def prepare_plan(self, plan: BatchPlan) -> PreparedPlan:
        """``plan``, from this cache's own oracle, checked as ``apply_plan(trusted=True)`` checks it and turned
        into one move per slot space, with the step's counts; nothing changes, and only what is fixed when the
        cache is built is read, so the planning thread can call it ahead of the step (``apply_plan(prepared=)``).

        Raises:
            as :meth:`apply_plan` with ``trusted=True``, for everything but the staged rows.
        """
        checked = {
            name: validate_plan(
                plan.step, cached_table(self._tables, plan.step, name), tp, None, self._optimizer_config, True
            )
            for name, tp in plan.tables.items()
        }
        # on a CUDA cache the slot indices go to pinned memory here, off the training thread
        pin = self._device.type == "cuda"
        return prepare(plan.step, True, checked, self._tables, self._spaces, self._cached, pin)

    def apply_plan(
        self,
        plan: BatchPlan,
        staged: Optional[StagedRows] = None,
        trusted: bool = False,
        prepared: Optional[PreparedPlan] = None,
        defer_write_backs: bool = False,
        writes: Writes = None,
    ) -> None:
        """Write back the plan's evicted rows and load its fetched rows, with their optimizer state: one gather
        and one scatter per slot space (the tables sharing one storage), weights and each state.

        The whole plan is validated before anything moves, so a refused plan leaves cache and stores unchanged.

        Args:
            plan: the step's plan; plans must be applied in order, each once, starting from an empty cache
                (after construction, :meth:`invalidate` or ``load_state_dict``).
            staged: rows gathered ahead by :meth:`stage` / :func:`stage_rows`; when absent, fetches are gathered
                from the stores now.
            trusted: the plan comes from this cache's own :class:`~torchrec_lookahead.oracle.LookaheadOracle`
                (as in :class:`~torchrec_lookahead.data.LookaheadDataModule`): only the cheap checks (shapes,
                slot and id ranges, staged rows) run, not the O(capacity) consistency checks against the cache
                contents, which the oracle's property tests guarantee; the next forward (and only that one, see
                :attr:`applied_plan`) then skips its checks of the cached features' slots (the loader remapped
                them with the same plan).
            prepared: ``plan`` as :meth:`prepare_plan` returned it (planned ahead, on another thread); with
                ``trusted`` only.
            defer_write_backs: leave the store writes of the evicted rows (of in-memory stores) to whoever reads
                a store next (:meth:`land_write_backs`: the planning loader's stager, before it gathers); the
                cache keeps only its copy of the rows.
            writes: per table, the evicted ids whose rows this rank writes back (stores shared by several ranks,
                :meth:`share_stores`); ``None``: every row, or none once the stores are shared.

        Raises:
            ConfigError: the plan names an unknown or resident table.
            DataError: a plan field is not a 1-D integer tensor, lengths differ, or staged rows have wrong
                shapes.
            CapacityError: a slot is not below the table's capacity.
            InvalidIdError: an id is out of the table's range.
            SetupError: the plan does not match the cache (evicting an id a slot does not hold, fetching into an
                occupied slot or an id already cached, reading an empty slot) or staged rows do not match the
                plan.
        """
        if prepared is None:
            checked: Dict[str, CheckedPlan] = {
                name: validate_plan(
                    plan.step,
                    cached_table(self._tables, plan.step, name),
                    tp,
                    staged,
                    self._optimizer_config,
                    trusted,
                )
                for name, tp in plan.tables.items()
            }
            if not trusted:
                check_shared_slots(plan.step, self._tables, checked)
            prepared = prepare(plan.step, trusted, checked, self._tables, self._spaces, self._cached)
        elif not trusted or prepared.step != plan.step:
            raise SetupError(
                f"plan step {plan.step}: a prepared plan (step {prepared.step}) is applied trusted, at its own step"
            )
        elif staged is not None:
            check_prepared_staged(prepared, staged, self._tables, self._optimizer_config)
        if staged is None:
            self.land_write_backs()  # the fetched rows are gathered from the stores below
        move(
            prepared,
            staged,
            self._tables,
            self._kernels,
            self._device,
            self._write_backs if defer_write_backs else None,
            self._unnamed if writes is None else writes,
        )
        self._counts += prepared.counts
        self._applied = AppliedPlan(plan.step, trusted)

    @property
    def applied_plan(self) -> Optional[AppliedPlan]:
        """The plan applied last, which the next forward covers (``None``: no plan since the last forward)."""
        return self._applied

    def consume_applied_plan(self) -> Optional[AppliedPlan]:
        """:attr:`applied_plan`, forgotten: the forward calls it, so that a trusted plan's skipped slot checks
        cover exactly one forward (the next one runs every check unless another plan is applied first)."""
        applied, self._applied = self._applied, None
        self.consumed_step = applied.step if applied is not None else self.consumed_step
        return applied

    # ------------------------------------------------------------------------------------------------------
    # durability and statistics
    # ------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def flush(self, writes: Writes = None) -> None:
        """Write every cached row (of those ``writes`` names, see :meth:`apply_plan`) and its optimizer state
        back to its store, then flush the stores.

        Rows stay cached: training continues with the same plan stream.
        """
        self.land_write_backs()
        writes = self._unnamed if writes is None else writes
        flush_rows(self._tables, self._kernels, self._device, self._counts, self._cached, writes)

    def share_stores(self) -> None:
        """The stores are shared by several ranks, each row written by one: from now on a write-back or flush
        writes only the rows its ``writes`` names, none without (a state dict's flush, after the owner's)."""
        self._unnamed = {}

    def invalidate(self) -> None:
        """Forget every cached row WITHOUT writing it back (call :meth:`flush` first to keep updates).

        Afterwards the cache is empty, so the plan stream must restart from an empty cache (a fresh oracle),
        and the plan applied last is forgotten (a trusted plan's skipped slot checks do not outlive its rows).
        """
        for t in self._tables.values():
            if t.slot_to_id is not None:
                t.slot_to_id.fill_(-1)
        self._applied = None
        self.consumed_step = None

    def stats(self) -> Dict[str, Dict[str, int]]:
        """Per cached table: steps, lookups, hits, rows_fetched, rows_written_back, rows_flushed, bytes_moved.

        ``hits`` counts lookups served by a row already cached before the step's fetches; ``lookups - hits``
        were served by a row fetched for the step.
        """
        return counted(self._cached, self._counts)

    def reset_stats(self) -> None:
        """Zero every counter."""
        self._counts.fill(0)

    # ------------------------------------------------------------------------------------------------------
    # checkpoints: full tables
    # ------------------------------------------------------------------------------------------------------
    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        self.flush()
        save_tables(self._tables, self._kernels, destination, prefix, self._COLLECTION)

    def _load_from_state_dict(
        self,
        state_dict: Dict[str, Any],
        prefix: str,
        local_metadata: Dict[str, Any],
        strict: bool,
        missing_keys: List[str],
        unexpected_keys: List[str],
        error_msgs: List[str],
    ) -> None:
        self.land_write_backs()  # before the stores are loaded, not over them
        if load_tables(
            self._tables,
            self._kernels,
            self._optimizer_config,
            state_dict,
            prefix,
            strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
            self._COLLECTION,
        ):
            self.invalidate()
