"""Checkpoint hooks of :class:`~torchrec_lookahead.modules.CachedEmbeddingBagCollection`: full tables.

A state dict holds every table in full, as ``embedding_bags.<table>.weight`` plus one
``embedding_bags.<table>.<state>`` per optimizer state, and ``optimizer_step``: the keys and shapes of a
resident ``EmbeddingBagCollection`` with a fused optimizer, so a checkpoint moves between the cached and the
resident model. A cached table's rows come from (and go to) its store; the caller flushes the cache before
saving and empties it after loading.

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

from typing import Any, Dict, List, Mapping, Sequence, Tuple

import torch

from torchrec_lookahead.modules._kernels import _CacheKernel
from torchrec_lookahead.modules._plans import _Table
from torchrec_lookahead.modules.config import CacheOptimizerConfig

__all__ = ["save_tables", "load_tables"]


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
        if t.store is not None:
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
    for name, t in tables.items():
        dim, n = t.config.embedding_dim, t.config.num_embeddings
        expected[f"{prefix}{collection}.{name}.weight"] = (n, dim)
        for s, w in optimizer.state_widths(dim).items():
            expected[f"{prefix}{collection}.{name}.{s}"] = (n, w)
    expected[prefix + "optimizer_step"] = ()
    errors = len(error_msgs)
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
            if key + "weight" not in state_dict:
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
