"""Batches that are not TorchRec ``Batch`` es: how the lookahead cache reads and rewrites them.

The cache plans from a batch's sparse features (a :class:`~torchrec.sparse.jagged_tensor.KeyedJaggedTensor`)
and hands the model the same batch with the cached tables' ids replaced by cache slots. A TorchRec
:class:`~torchrec.datasets.utils.Batch` says where its KJT is; any other batch (a dict, usual for two-tower
models; a tuple; a dataclass of the user's own) needs a :class:`BatchAdapter`: a function from the user's batch
to ``(dense features, KJT, labels)``. The batch the model trains on is the user's own, of the user's own type,
its KJT swapped for the remapped one (found by identity inside dicts, lists, tuples and dataclasses, or by the
adapter's ``replace_sparse``).

Example:
    >>> import torch
    >>> from torchrec import KeyedJaggedTensor
    >>> kjt = KeyedJaggedTensor(keys=["user"], values=torch.tensor([3, 1]), lengths=torch.tensor([1, 1]))
    >>> batch = {"x": torch.zeros(2, 1), "ids": kjt, "y": torch.ones(2)}
    >>> adapter = DictBatchAdapter(dense_key="x", sparse_key="ids", labels_key="y")
    >>> as_torchrec_batch(batch, adapter).sparse_features is kjt
    True
    >>> slots = KeyedJaggedTensor(keys=["user"], values=torch.tensor([0, 1]), lengths=torch.tensor([1, 1]))
    >>> adapter.with_sparse(batch, kjt, slots)["ids"].values().tolist()
    [0, 1]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Tuple

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.errors import ConfigError, DataError

__all__ = ["BatchAdapter", "DictBatchAdapter", "as_torchrec_batch", "replace_by_identity"]

SplitFn = Callable[[Any], Tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]]
ReplaceFn = Callable[[Any, KeyedJaggedTensor], Any]


class BatchAdapter:
    """How to read a batch that is not a TorchRec ``Batch``.

    Args:
        split: the user's batch -> ``(dense_features, sparse_features, labels)``: a tensor of shape (B, D), the
            batch's :class:`~torchrec.sparse.jagged_tensor.KeyedJaggedTensor` (the very object the model reads)
            and a tensor of shape (B,). In a LightningCLI config, an import path (``my_package.split_batch``).
        replace_sparse: the user's batch with its KJT replaced by the given one (the cached tables' ids
            remapped to cache slots), of the type the model's ``training_step`` takes. Default: the KJT
            ``split`` returned is found by identity in the batch (nested dicts, lists, tuples, dataclasses
            and named tuples) and replaced in a shallow copy.

    Example:
        >>> import torch
        >>> from torchrec import KeyedJaggedTensor
        >>> kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1]), lengths=torch.tensor([1]))
        >>> adapter = BatchAdapter(lambda b: (b[0], b[1], b[2]))
        >>> batch = (torch.zeros(1, 2), kjt, torch.ones(1))
        >>> as_torchrec_batch(batch, adapter).labels.tolist()
        [1.0]
    """

    def __init__(self, split: SplitFn, replace_sparse: Optional[ReplaceFn] = None) -> None:
        if not callable(split):
            raise ConfigError(f"BatchAdapter(split=...) must be callable but got {type(split).__name__}")
        if replace_sparse is not None and not callable(replace_sparse):
            raise ConfigError(
                f"BatchAdapter(replace_sparse=...) must be callable or None but got {type(replace_sparse).__name__}"
            )
        self._split = split
        self._replace = replace_sparse

    def split(self, batch: Any) -> Tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
        """``(dense_features, sparse_features, labels)`` of ``batch``.

        Raises:
            DataError: the adapter did not return a triple whose middle element is a ``KeyedJaggedTensor``.
        """
        out = self._split(batch)
        if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[1], KeyedJaggedTensor)):
            got = (
                type(out[1]).__name__
                if isinstance(out, tuple) and len(out) == 3
                else repr(type(out).__name__)
            )
            raise DataError(
                "a BatchAdapter's split must return (dense_features, sparse_features, labels) with a "
                f"KeyedJaggedTensor in the middle but returned {got}; fix the adapter function"
            )
        return out

    def with_sparse(self, batch: Any, old: KeyedJaggedTensor, new: KeyedJaggedTensor) -> Any:
        """``batch`` with its KJT ``old`` (what :meth:`split` returned) replaced by ``new``.

        Raises:
            ConfigError: no ``replace_sparse`` was given and ``old`` is not an element of the batch.
        """
        if self._replace is not None:
            return self._replace(batch, new)
        found, out = replace_by_identity(batch, old, new)
        if not found:
            raise ConfigError(
                f"the KeyedJaggedTensor the BatchAdapter's split returned is not an element of the "
                f"{type(batch).__name__} batch (it built a new one?), so the cache cannot hand the model the batch "
                "with cache slots: return the batch's own KJT from split, or give BatchAdapter(replace_sparse=...)"
            )
        return out


class DictBatchAdapter(BatchAdapter):
    """The adapter of dict batches: the dense features, KJT and labels under three keys.

    Args:
        dense_key: key of the dense features, shape (B, D).
        sparse_key: key of the :class:`~torchrec.sparse.jagged_tensor.KeyedJaggedTensor`.
        labels_key: key of the labels, shape (B,).

    Example:
        >>> DictBatchAdapter(sparse_key="ids").sparse_key
        'ids'
    """

    def __init__(
        self, dense_key: str = "dense", sparse_key: str = "sparse", labels_key: str = "labels"
    ) -> None:
        self.dense_key = dense_key
        self.sparse_key = sparse_key
        self.labels_key = labels_key
        super().__init__(self._split_dict, self._replace_dict)

    def _split_dict(self, batch: Any) -> Tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
        if not isinstance(batch, Mapping):
            raise DataError(f"DictBatchAdapter reads dict batches but got a {type(batch).__name__}")
        missing = [k for k in (self.dense_key, self.sparse_key, self.labels_key) if k not in batch]
        if missing:
            raise DataError(
                f"DictBatchAdapter: the batch has no key(s) {missing} (its keys are {sorted(map(str, batch))}); "
                "set dense_key, sparse_key and labels_key to the batch's own"
            )
        return batch[self.dense_key], batch[self.sparse_key], batch[self.labels_key]

    def _replace_dict(self, batch: Any, new: KeyedJaggedTensor) -> Any:
        out = dict(batch)
        out[self.sparse_key] = new
        return out


def replace_by_identity(obj: Any, old: Any, new: Any) -> Tuple[bool, Any]:
    """``(found, copy of obj with the object `old` replaced by new)``, looking into mappings, lists, tuples
    (named tuples too) and dataclasses; containers without ``old`` come back unchanged.

    Example:
        >>> a, b = object(), object()
        >>> found, out = replace_by_identity({"k": [1, a]}, a, b)
        >>> found, out["k"][1] is b
        (True, True)
    """
    if obj is old:
        return True, new
    if isinstance(obj, Mapping):
        items = {k: replace_by_identity(v, old, new) for k, v in obj.items()}
        if not any(f for f, _ in items.values()):
            return False, obj
        replaced = {k: v for k, (_, v) in items.items()}
        cls: Any = type(obj)
        return True, replaced if cls is dict else cls(replaced)
    if isinstance(obj, (list, tuple)):
        parts = [replace_by_identity(v, old, new) for v in obj]
        if not any(f for f, _ in parts):
            return False, obj
        values = [v for _, v in parts]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return True, type(obj)(*values)
        return True, type(obj)(values)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            found, value = replace_by_identity(getattr(obj, f.name), old, new)
            if found:
                changes[f.name] = value
        if not changes:
            return False, obj
        return True, dataclasses.replace(obj, **changes)
    return False, obj


def as_torchrec_batch(batch: Any, adapter: Optional[BatchAdapter]) -> Batch:
    """``batch`` as a TorchRec ``Batch``: itself when it is one, else read through ``adapter``, the result a
    :class:`~torchrec_lookahead.runtime.LookaheadBatch` that remembers the user's batch (``source``).

    Raises:
        DataError: ``batch`` is not a TorchRec ``Batch`` and there is no adapter (the message says what to
            pass), or the adapter's output is malformed.
    """
    if isinstance(batch, Batch):
        return batch
    if adapter is None:
        keys = f" with keys {sorted(map(str, batch))}" if isinstance(batch, Mapping) else ""
        raise DataError(
            f"the training loader yields {type(batch).__name__} batches{keys}, not TorchRec Batches (dense_features, "
            "sparse_features, labels): pass LookaheadDataModule(batch_adapter=...) a torchrec_lookahead.runtime."
            "DictBatchAdapter(dense_key=..., sparse_key=..., labels_key=...) for dict batches, "
            "or a torchrec_lookahead.runtime.BatchAdapter(split=<your batch -> (dense, KJT, labels)>)"
        )
    from torchrec_lookahead.runtime.batch import LookaheadBatch

    dense, sparse, labels = adapter.split(batch)
    return LookaheadBatch(dense, sparse, labels, source=batch, adapter=adapter)
