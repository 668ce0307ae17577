"""Initialise a resident TorchRec model's tables with the stores' deterministic values."""

from __future__ import annotations

from typing import Dict, Sequence

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec_lookahead.store.init import init_rows

__all__ = ["init_embedding_bag_tables_"]


@torch.no_grad()
def init_embedding_bag_tables_(
    module: nn.Module, tables: Sequence[EmbeddingBagConfig], seed: int, chunk_rows: int = 65536
) -> Dict[str, int]:
    """Write :func:`~torchrec_lookahead.store.init_rows` values into every ``embedding_bags.<table>.weight``
    (EmbeddingBagCollection) and ``embeddings.<table>.weight`` (EmbeddingCollection).

    Works on a plain ``EmbeddingBagCollection`` (or a model containing one) and on a
    ``DistributedModelParallel`` model, whose state dict holds ``ShardedTensor`` s: each local shard receives
    the rows and columns it owns (table-wise, row-wise and column-wise shards alike), in place, so the fused
    TBE weights behind the shards change.

    Args:
        module: the model.
        tables: configs of the tables to initialise.
        seed: the seed the cached run uses.
        chunk_rows: rows generated at a time.

    Returns:
        Table name -> number of rows written on this rank.

    Example:
        >>> from torchrec import EmbeddingBagCollection
        >>> t = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"])]
        >>> ebc = EmbeddingBagCollection(tables=t)
        >>> init_embedding_bag_tables_(ebc, t, seed=0)
        {'t0': 10}
        >>> torch.equal(ebc.embedding_bags["t0"].weight, init_rows(0, "t0", 0, 10, 4, 10))
        True
    """
    by_name = {c.name: c for c in tables}
    written = dict.fromkeys(by_name, 0)
    for key, value in module.state_dict().items():
        parts = key.split(".")
        if (
            len(parts) < 3
            or parts[-1] != "weight"
            or parts[-3] not in ("embedding_bags", "embeddings")
            or parts[-2] not in by_name
        ):
            continue
        cfg = by_name[parts[-2]]
        n, dim = cfg.num_embeddings, cfg.embedding_dim
        if hasattr(value, "local_shards"):
            shards = [(s.tensor, s.metadata.shard_offsets) for s in value.local_shards()]
        else:
            shards = [(value, [0, 0])]
        for tensor, (row0, col0) in shards:
            rows, cols = tensor.shape
            for lo in range(0, rows, chunk_rows):
                hi = min(lo + chunk_rows, rows)
                vals = init_rows(seed, cfg.name, row0 + lo, row0 + hi, dim, n)[:, col0 : col0 + cols]
                tensor[lo:hi].copy_(vals.to(tensor.device, tensor.dtype))
            written[cfg.name] += rows
    return written
