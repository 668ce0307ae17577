"""Checkpoint hooks of :class:`~torchrec_lookahead.modules.CachedEmbeddingBagCollection`: full tables.

A state dict holds every table in full, as ``embedding_bags.<table>.weight`` plus one
``embedding_bags.<table>.<state>`` per optimizer state, and ``optimizer_step``: the keys and shapes of a
resident ``EmbeddingBagCollection`` with a fused optimizer, so a checkpoint moves between the cached and the
resident model. A cached table's rows come from (and go to) its store; the caller flushes the cache before
saving and empties it after loading.

Under :func:`store_files` (a checkpoint of :class:`~torchrec_lookahead.strategies.TorchRecStrategy`), a table
in a disk store, which may be larger than memory, is instead one ``embedding_bags.<table>.store_files`` entry
(its row count): the checkpoint keeps copies of its store files, made and read a run of units at a time.

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagConfig
    >>> from torchrec_lookahead.modules import CacheOptimizerConfig, CachedEmbeddingBagCollection
    >>> tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])]
    >>> ebc = CachedEmbeddingBagCollection(tables, {"t": 4}, CacheOptimizerConfig("exact_sgd"))
    >>> sorted((k, tuple(v.shape)) for k, v in ebc.state_dict().items())
    [('embedding_bags.t.weight', (10, 4)), ('optimizer_step', ())]
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from torchrec_lookahead.errors import CheckpointError
from torchrec_lookahead.modules._kernels import _CacheKernel
from torchrec_lookahead.modules._plans import _Table
from torchrec_lookahead.modules.config import CacheOptimizerConfig
from torchrec_lookahead.store import EmbeddingStore

__all__ = ["FILES_KEY", "StoreFiles", "store_files", "save_tables", "load_tables"]

#: the key (after ``<collection>.<table>.``) that stands for a table a checkpoint keeps in copies of its store
#: files: its value is the table's row count
FILES_KEY = "store_files"


class StoreFiles:
    """The cached tables a checkpoint keeps as copies of their store files (:attr:`EmbeddingStore.keeps_files`:
    disk stores, whose tables may be larger than memory), collected while a state dict is built under
    :func:`store_files`; the caller writes their pieces (:meth:`EmbeddingStore.save_files`) and loads them back
    (:meth:`load`)."""

    def __init__(self) -> None:
        self.stores: Dict[str, EmbeddingStore] = {}

    def __bool__(self) -> bool:
        return bool(self.stores)

    def add(self, table: str, store: EmbeddingStore) -> None:
        """Collect ``store``, the store of ``table`` (``<collection>.<table name>``: its sub-directory)."""
        if self.stores.get(table, store) is not store:
            raise CheckpointError(
                f"two cached tables are named '{table}': a checkpoint keeps disk stores' files by table name; "
                "give the tables distinct names"
            )
        self.stores[table] = store

    def load(self, chains: Mapping[str, Sequence[str]]) -> None:
        """Load every table's files on this rank from its chain of pieces (``chains``: table -> piece paths,
        oldest first).

        Raises:
            CheckpointError: a table has no chain.
        """
        for key, store in self.stores.items():
            if key not in chains:
                raise CheckpointError(
                    f"the checkpoint holds no copy of table '{key}''s disk store on this rank"
                )
            store.load_files(chains[key])


_collecting: Optional[StoreFiles] = None


@contextlib.contextmanager
def store_files() -> Iterator[StoreFiles]:
    """While active, cached collections' state dicts stand for each table kept in files by a ``store_files``
    entry (``FILES_KEY``, its row count) instead of its full tensors, and collect its store in the yielded
    :class:`StoreFiles` (a checkpoint's state dict: nothing of the table is copied into memory)."""
    global _collecting
    previous, _collecting = _collecting, StoreFiles()
    try:
        yield _collecting
    finally:
        _collecting = previous


def save_tables(
    tables: Mapping[str, _Table],
    kernels: Sequence[_CacheKernel],
    destination: Dict[str, Any],
    prefix: str,
    collection: str = "embedding_bags",
) -> None:
    """Add every table's full weights and optimizer state, and the optimizer step, to ``destination`` (under
    ``<collection>.<table>.``: ``embedding_bags`` as TorchRec's EmbeddingBagCollection, ``embeddings`` as its
    EmbeddingCollection)."""
    for name, t in tables.items():
        key = f"{prefix}{collection}.{name}."
        if t.store is not None and _collecting is not None and t.store.keeps_files:
            destination[key + FILES_KEY] = torch.tensor(t.config.num_embeddings, dtype=torch.int64)
            _collecting.add(f"{collection}.{name}", t.store)
        elif t.store is not None:
            destination[key + "weight"] = t.store.full_weights()
            for s, v in t.store.full_states().items():
                destination[key + s] = v
        else:
            kernel = kernels[t.group]
            destination[key + "weight"] = kernel.weights(t.local).detach()
            for s, v in kernel.states(t.local).items():
                destination[key + s] = v.detach()
    destination[prefix + "optimizer_step"] = torch.tensor(kernels[0].get_step(), dtype=torch.int64)


def load_tables(
    tables: Mapping[str, _Table],
    kernels: Sequence[_CacheKernel],
    optimizer: CacheOptimizerConfig,
    state_dict: Mapping[str, Any],
    prefix: str,
    strict: bool,
    missing_keys: List[str],
    unexpected_keys: List[str],
    error_msgs: List[str],
    collection: str = "embedding_bags",
) -> bool:
    """Load full tables from ``state_dict`` into the stores (cached tables) and kernels (resident ones), as
    ``nn.Module._load_from_state_dict``: missing keys, unexpected keys and shape errors are appended to the lists.

    Returns:
        Whether anything was loaded (``False`` when a shape was wrong: nothing is written then).
    """
    expected: Dict[str, Tuple[int, ...]] = {}
    in_files: List[str] = []  # tables the checkpoint keeps in copies of their store files
    errors = len(error_msgs)
    for name, t in tables.items():
        dim, n = t.config.embedding_dim, t.config.num_embeddings
        key = f"{prefix}{collection}.{name}."
        if key + FILES_KEY in state_dict:
            in_files.append(name)
            expected[key + FILES_KEY] = ()
            if _collecting is None or t.store is None or not t.store.keeps_files:
                error_msgs.append(
                    f"{key}{FILES_KEY}: the checkpoint keeps table '{name}' in copies of its disk store files, "
                    "which only a model whose table is in a disk store (store: disk) loads, through "
                    "TorchRecStrategy's checkpoint (ckpt_path=...); `export` turns such a checkpoint into full tables"
                )
            elif int(state_dict[key + FILES_KEY]) != n:
                error_msgs.append(
                    f"{key}{FILES_KEY}: the checkpoint's table '{name}' has {int(state_dict[key + FILES_KEY])} rows, "
                    f"this model's {n}"
                )
            continue
        expected[key + "weight"] = (n, dim)
        for s, w in optimizer.state_widths(dim).items():
            expected[f"{key}{s}"] = (n, w)
    expected[prefix + "optimizer_step"] = ()
    for key, shape in expected.items():
        if key not in state_dict:
            missing_keys.append(key)
        elif tuple(state_dict[key].shape) != shape and not (
            len(shape) == 2 and shape[1] == 1 and tuple(state_dict[key].shape) == shape[:1]
        ):
            error_msgs.append(f"{key}: expected shape {shape} but got {tuple(state_dict[key].shape)}")
    if strict:
        ours = f"{prefix}{collection}."
        for key in state_dict:
            if key.startswith(ours) and key not in expected:
                unexpected_keys.append(key)
    if len(error_msgs) > errors:
        return False
    with torch.no_grad():
        for name, t in tables.items():
            key = f"{prefix}{collection}.{name}."
            # a table kept in files is loaded by the caller (StoreFiles)
            if name in in_files or key + "weight" not in state_dict:
                continue
            widths = optimizer.state_widths(t.config.embedding_dim)
            states = {s: state_dict[key + s] for s in widths if key + s in state_dict}
            if t.store is not None:
                t.store.load(state_dict[key + "weight"], states)
            else:
                kernel = kernels[t.group]
                kernel.weights(t.local).copy_(state_dict[key + "weight"])
                for s, v in kernel.states(t.local).items():
                    if s in states:
                        v.copy_(states[s].reshape(v.shape))
                    else:
                        v.zero_()
        if prefix + "optimizer_step" in state_dict:
            for kernel in kernels:
                kernel.set_step(int(state_dict[prefix + "optimizer_step"]))
    return True
