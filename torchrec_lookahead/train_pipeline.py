"""``LookaheadTrainPipeline``: TorchRec's train pipeline for plain loops, with the lookahead cache.

A plain TorchRec loop trains through TorchRec's :class:`~torchrec.distributed.train_pipeline.TrainPipelineBase`
(``pipeline.progress(dataloader_iter)`` per step: batch to device, forward, backward, optimizer). This
pipeline extends it, so that a model sharded with the
:class:`~torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder` trains its cached tables with
the same loop::

    pipeline = LookaheadTrainPipeline(dmp, optimizer, device)   # instead of TrainPipelineBase(...)
    with pipeline:
        it = iter(dataloader)
        while True:
            try:
                pipeline.progress(it)
            except StopIteration:
                break

Behind ``progress``, the :class:`~torchrec_lookahead.runtime.LookaheadLoader` that the Lightning path uses reads
``dataloader_iter`` in a background thread, runs the oracle ``horizon`` batches ahead and remaps the cached
features' ids to cache slots; a second thread gathers the rows each plan fetches ``prefetch_depth`` steps ahead.
Before each step the batch's plan is applied to the cached modules (exactly as ``strategy="torchrec"`` does,
through :meth:`~torchrec_lookahead.runtime.CacheSession.apply`), then TorchRec's step runs unchanged. The
data is streamed: only ``queue_depth`` planned batches and the oracle's ``horizon`` of ids are held.

With several ranks every rank runs the same pipeline on its own part of the data (as in the resident loop);
the planner threads gather every rank's ids of each batch in lockstep, so all ranks plan the global batch
(LRPP). When the stream ends, ``progress`` writes every cached row back to the host stores and raises
``StopIteration``; ``flush()`` does so at any time, and the context manager on exit.
"""

from __future__ import annotations

import logging
import weakref
from types import TracebackType
from typing import Any, Generator, Iterable, Iterator, List, Optional, Type, Union

import torch
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipelineBase

from torchrec_lookahead.distributed import ShardedLookaheadCollection
from torchrec_lookahead.errors import ConfigError, DataError, SetupError
from torchrec_lookahead.oracle import LookaheadSettings, Policy
from torchrec_lookahead.oracle.config import DEFAULT_HORIZON, DEFAULT_PREFETCH_DEPTH
from torchrec_lookahead.runtime import CacheSession, LookaheadBatch, LookaheadLoader, check_loader_options

__all__ = ["LookaheadTrainPipeline"]

log = logging.getLogger(__name__)

#: per cached collection, the pipeline whose stream last started on it (its caches hold that stream's rows): a
#: new stream of another pipeline closes that one's
_STREAM_OWNER: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[LookaheadTrainPipeline]] = (
    weakref.WeakKeyDictionary()
)


class LookaheadTrainPipeline(TrainPipelineBase[Batch, Any]):
    """TorchRec's ``TrainPipelineBase`` whose steps train the model's cached tables (module docstring).

    The model's forward takes a TorchRec :class:`~torchrec.datasets.utils.Batch` and returns ``(loss, output)``,
    as for TorchRec's pipelines (e.g. ``DistributedModelParallel(DLRMTrain(dlrm), ...)``); ``progress`` returns
    ``output``. A model without cached tables trains exactly as under ``TrainPipelineBase``.

    Args:
        model: the ``DistributedModelParallel`` model (sharded with the lookahead sharder and a
            :func:`~torchrec_lookahead.distributed.lookahead_sharding_plan`).
        optimizer: the optimizer stepped after each backward (e.g. ``CombinedOptimizer([dmp.fused_optimizer,
            dense])``).
        device: the device batches are moved to.
        horizon: batches the oracle reads ahead.
        prefetch_depth: steps ahead the fetched rows are gathered (at most ``horizon``).
        policy: a :class:`~torchrec_lookahead.oracle.Policy` or its value (``belady``, ``ttl``, ``window``,
            ``lru``).
        queue_depth: planned batches kept ready (bounds memory and the oracle's lead).
        window: batches per window of the ``window`` policy.
        ways: associativity of the ``window`` policy.
        stop_timeout_s: with several ranks, how long a rank that stops waits for the others to join the planner's
            last id all-gather before it gives up with a :class:`~torchrec_lookahead.errors.SetupError`.
        planner_nice: nice value of the reader and planner threads (0 to 19; see
            :class:`~torchrec_lookahead.data.LookaheadDataModule`).

    Raises:
        ConfigError: ``model`` is not a ``torch.nn.Module``, ``optimizer`` has no ``step``/``zero_grad``,
            ``device`` is not a device (a string such as ``"cuda:0"`` is taken as ``torch.device``), or a bad
            ``horizon``, ``prefetch_depth``, ``policy`` or other oracle setting.

    Bad ids and windows that do not fit the cache raise the oracle's typed errors
    (:class:`~torchrec_lookahead.errors.InvalidIdError`, :class:`~torchrec_lookahead.errors.CapacityError`)
    from ``progress`` once the oracle, ``horizon`` batches ahead of training, reaches them: a stream has no
    length to check in advance.

    Example:
        >>> import tempfile
        >>> import torch
        >>> import torch.distributed as dist
        >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        >>> from torchrec.distributed import DistributedModelParallel
        >>> from torchrec.distributed.planner import Topology
        >>> from torchrec.models.dlrm import DLRM, DLRMTrain
        >>> from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        >>> from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
        >>> from torchrec.optim.optimizers import in_backward_optimizer_filter
        >>> from torchrec_lookahead.data import CriteoSyntheticDataset, SyntheticCriteoConfig
        >>> from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
        >>> from torchrec_lookahead.distributed import lookahead_sharding_plan
        >>> if not dist.is_initialized():
        ...     dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
        >>> data = CriteoSyntheticDataset(SyntheticCriteoConfig(batch_size=16, num_batches=3,
        ...                                                     num_embeddings=[20] * 26))
        >>> tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=4, num_embeddings=n, feature_names=[f])
        ...           for f, n in data.num_embeddings_per_feature().items()]
        >>> ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        >>> dlrm = DLRM(embedding_bag_collection=ebc, dense_in_features=13, dense_arch_layer_sizes=[8, 4],
        ...             over_arch_layer_sizes=[4, 1])
        >>> apply_optimizer_in_backward(torch.optim.SGD, dlrm.sparse_arch.parameters(), {"lr": 0.1})
        >>> capacity = {"t_cat_0": 16}
        >>> sharders = [LookaheadEmbeddingBagCollectionSharder(capacity=capacity)]
        >>> topology = Topology(world_size=1, compute_device="cpu")
        >>> plan = lookahead_sharding_plan(DLRMTrain(dlrm), sharders, capacity, topology)
        >>> dmp = DistributedModelParallel(DLRMTrain(dlrm), device=torch.device("cpu"), sharders=sharders, plan=plan)
        >>> dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
        ...                               lambda ps: torch.optim.SGD(ps, lr=0.1))
        >>> optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
        >>> steps = 0
        >>> with LookaheadTrainPipeline(dmp, optimizer, torch.device("cpu"), horizon=4) as pipeline:
        ...     it = iter(data)
        ...     while True:
        ...         try:
        ...             loss, logits, labels = pipeline.progress(it)
        ...         except StopIteration:
        ...             break
        ...         steps += 1
        >>> steps
        3
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        horizon: int = DEFAULT_HORIZON,
        prefetch_depth: int = DEFAULT_PREFETCH_DEPTH,
        policy: Union[Policy, str] = Policy.BELADY,
        queue_depth: int = 8,
        window: Optional[int] = None,
        ways: Optional[int] = None,
        stop_timeout_s: float = 60.0,
        planner_nice: int = 19,
    ) -> None:
        device = _checked_arguments(model, optimizer, device)
        settings = LookaheadSettings(horizon, prefetch_depth, policy, window, ways)
        queue_depth, stop_timeout_s, planner_nice = check_loader_options(
            queue_depth, stop_timeout_s, planner_nice
        )
        super().__init__(model, optimizer, device)
        self._batches: Optional[Iterator[Batch]] = None
        #: the iterator of the cached stream in progress, and one a close() left mid-stream (read ahead of training:
        #: the batches the planner took from it are gone with the stream)
        self._source: Optional[Iterator[Batch]] = None
        self._abandoned: Optional[Iterator[Batch]] = None
        self.loader: Optional[LookaheadLoader] = None
        #: the owner of the cached step (collective with several ranks: the planner's id group)
        self.session = CacheSession.for_model(model)
        if self.session is None:
            log.warning(
                "LookaheadTrainPipeline: the model has no cached tables; batches pass through unplanned"
            )
            return
        #: the lookahead loader reading the connected data iterator (its ``stats()`` count waits and CPU time)
        self.loader = LookaheadLoader(
            None,
            self.session,
            settings,
            queue_depth,
            stop_timeout_s=stop_timeout_s,
            planner_nice=planner_nice,
        )

    @property
    def cached(self) -> List[ShardedLookaheadCollection[Any, Any]]:
        """The model's collections with cached tables."""
        return [] if self.session is None else list(self.session.modules)

    # ------------------------------------------------------------------- TorchRec's TrainPipelineBase hooks
    def _connect(self, dataloader_iter: Iterator[Batch]) -> None:
        if self.loader is None:
            self._batches = dataloader_iter
        else:
            if dataloader_iter is self._abandoned:
                raise SetupError(
                    "this iterator's stream was closed mid-way (by close(), an error, or another pipeline's stream "
                    "on the same model): the cache's planner had read batches ahead of training from it, and they "
                    "went with the stream; pass a new iterator (iter(dataloader)) to start a new stream"
                )
            self._claim_caches()
            self.loader.loader = _torchrec_batches(dataloader_iter)
            self._batches = iter(self.loader)  # a new stream starts from empty caches (flushed first)
            self._source, self._abandoned = dataloader_iter, None
        super()._connect(dataloader_iter)

    def _claim_caches(self) -> None:
        """Make this pipeline the owner of the model's caches for the stream it starts: another pipeline's stream
        in progress on them (left open, e.g. by an exception in a loop without ``with``) is closed first, since
        the new stream empties the caches its plans rely on (its iterator is then refused, as after
        :meth:`close`, instead of training wrong rows)."""
        modules = [] if self.session is None else self.session.modules
        for m in modules:
            ref = _STREAM_OWNER.get(m)
            other = ref() if ref is not None else None
            if other is not None and other is not self and other._source is not None:
                log.warning(
                    "LookaheadTrainPipeline: another pipeline's stream on this model's cached tables was in "
                    "progress; it is closed (its iterator is refused from now on)"
                )
                other.close()
        for m in modules:
            _STREAM_OWNER[m] = weakref.ref(self)

    def _next_batch(self, dataloader_iter: Iterator[Batch]) -> Optional[Batch]:
        if self._batches is None:
            raise SetupError(
                "LookaheadTrainPipeline has no stream: call progress(dataloader_iter) to start one"
            )
        return super()._next_batch(self._batches)

    def _wait_for_batch(self, cur_batch: Batch) -> None:
        super()._wait_for_batch(cur_batch)
        if isinstance(cur_batch, LookaheadBatch) and self.session is not None:
            # After the previous step's optimizer update, before this step's forward (no stale read).
            self.session.apply(cur_batch)

    def progress(self, dataloader_iter: Iterator[Batch]) -> Any:
        """One training step on the next batch of ``dataloader_iter`` (a new iterator after the end of the
        previous one starts a new stream, from empty caches).

        Returns:
            The model's ``output``.

        Raises:
            StopIteration: the stream has ended (the caches have been written back to the host stores).
            SetupError: the model is in eval mode (call ``model.train()``; nothing changes), or
                ``dataloader_iter`` is not the iterator of the stream in progress (call :meth:`reset`
                first: the planner has read ahead of training from the stream's own iterator); nothing changes.
                A stream in progress of another pipeline on the same model is closed (its iterator then refused).
        """
        if self.loader is not None and not self._model.training:
            # before the step: a planned batch in eval mode is refused by the cached modules mid-forward, and the
            # stream, read ahead of training, would be lost with it
            raise SetupError(
                "LookaheadTrainPipeline trains (its batches hold cache slots) but the model is in eval mode: call "
                "model.train() before progress() (the stream in progress goes on); evaluate a cached model by "
                "calling it on unplanned batches in eval mode"
            )
        if self._connected and self._source is not None and dataloader_iter is not self._source:
            raise SetupError(
                "progress() got another iterator while a stream is in progress: the cache's planner has read "
                "batches ahead of training from the stream's own; call reset() (or close()) to end it first, "
                "then pass the new iterator"
            )
        try:
            return super().progress(dataloader_iter)
        except StopIteration:
            self._source = None  # ended: nothing was read ahead of it
            self.flush()
            self.reset()
            raise
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------ end of training
    def flush(self, barrier: bool = True) -> None:
        """Write every cached row and its optimizer state back to the host stores (``barrier=False`` on an
        exception path, where another rank may be gone: see
        :meth:`~torchrec_lookahead.distributed.ShardedLookaheadCollection.flush`)."""
        if self.session is not None:
            self.session.flush(barrier=barrier)

    def close(self) -> None:
        """Stop the background threads (a later ``progress`` starts a new stream, from a new iterator: the one of
        a stream closed mid-way is refused, its batches read ahead of training having gone with the stream)."""
        if self.loader is not None:
            stream, self._batches = self._batches, None
            if isinstance(stream, Generator):
                stream.close()  # its own cleanup now, not at a garbage collection (at exit: without threading)
            self.loader.close()
        if self._source is not None:
            self._abandoned, self._source = self._source, None
        self._reset_data_iter()

    def reset(self) -> None:
        """TorchRec's reset: forget the connected iterator and stop the background threads."""
        self.close()

    def __enter__(self) -> LookaheadTrainPipeline:
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        try:
            self.close()
        finally:
            self.flush(barrier=exc is None)


def _checked_arguments(model: Any, optimizer: Any, device: Any) -> torch.device:
    """``device`` as a ``torch.device``, once ``model``, ``optimizer`` and ``device`` are of the types TorchRec's
    pipeline uses (its own errors are AttributeErrors at the first step).

    Raises:
        ConfigError: one of them is not.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"LookaheadTrainPipeline's model must be a torch.nn.Module (the DistributedModelParallel model) but got "
            f"{type(model).__name__}"
        )
    if not all(callable(getattr(optimizer, name, None)) for name in ("step", "zero_grad")):
        raise ConfigError(
            f"LookaheadTrainPipeline's optimizer must be an optimizer (step() and zero_grad(), e.g. "
            f"CombinedOptimizer([dmp.fused_optimizer, dense])) but got {type(optimizer).__name__}"
        )
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as e:
            raise ConfigError(
                f"LookaheadTrainPipeline's device must be a device but got {device!r}: {e}"
            ) from None
    if not isinstance(device, torch.device):
        raise ConfigError(
            f"LookaheadTrainPipeline's device must be a torch.device (or its name, e.g. 'cuda:0') but got "
            f"{type(device).__name__}"
        )
    return device


def _torchrec_batches(source: Iterable[Any]) -> Iterator[Batch]:
    """``source``'s batches, each checked to be a TorchRec ``Batch`` (read by the loader's reader thread: the
    error reaches ``progress``), as the pipeline has no ``batch_adapter``.

    Raises:
        DataError: a batch is not a TorchRec ``Batch``.
    """
    for batch in source:
        if not isinstance(batch, Batch):
            keys = f" with keys {sorted(map(str, batch))}" if isinstance(batch, dict) else ""
            raise DataError(
                f"LookaheadTrainPipeline's iterator yields {type(batch).__name__} batches{keys}, not TorchRec "
                "Batches (dense_features, sparse_features, labels) as TorchRec's pipelines take: convert them in "
                "the iterator (e.g. map each to torchrec.datasets.utils.Batch); other batch types go through the "
                "cache on the Lightning path, LookaheadDataModule(batch_adapter=...)"
            )
        yield batch
