"""Deterministic initial embedding values, shared by the stores and by resident models.

Initial rows are defined by blocks of :data:`INIT_BLOCK_ROWS` rows: block ``b`` of table ``table`` is drawn by
a ``torch.Generator`` seeded from a stable hash of ``(seed, table, b)`` as
``uniform(-sqrt(1/N), sqrt(1/N))``, TorchRec's default ``EmbeddingBagConfig`` initialisation. So the value of
a row depends only on the seed, the table name, the table size and the row index, never on how a caller
chunks its initialisation: a memory-mapped store initialised lazily chunk by chunk, an in-RAM store and a
resident TorchRec table initialised with :func:`init_embedding_weights` hold the same numbers bit for bit.

Example:
    >>> import torch
    >>> a = init_rows(seed=0, table="t0", start=0, stop=10, dim=4, num_embeddings=100)
    >>> b = torch.cat([init_rows(0, "t0", 0, 3, 4, 100), init_rows(0, "t0", 3, 10, 4, 100)])
    >>> torch.equal(a, b), bool(a.abs().max() <= 0.1)
    (True, True)
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional

import torch

from torchrec_lookahead.errors import ConfigError

__all__ = ["INIT_BLOCK_ROWS", "init_rows", "init_embedding_weights"]

INIT_BLOCK_ROWS: int = 8192
"""Rows per generator block; changing it changes every initial value."""


def _block_seed(seed: int, table: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{table}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def init_rows(seed: int, table: str, start: int, stop: int, dim: int, num_embeddings: int) -> torch.Tensor:
    """Initial weights of rows ``[start, stop)`` of a table.

    Args:
        seed: global seed of the run.
        table: table name (different tables get independent values).
        start: first row.
        stop: one past the last row.
        dim: embedding dimension.
        num_embeddings: rows of the whole table (sets the bound ``sqrt(1/num_embeddings)``).

    Returns:
        (stop - start, dim) float32 tensor.

    Raises:
        ConfigError: ``0 <= start <= stop <= num_embeddings`` or ``dim > 0`` does not hold.
    """
    if not 0 <= start <= stop <= num_embeddings or dim <= 0:
        raise ConfigError(
            f"init_rows for table '{table}': expected 0 <= start <= stop <= num_embeddings and dim > 0 but got "
            f"start={start}, stop={stop}, num_embeddings={num_embeddings}, dim={dim}"
        )
    bound = math.sqrt(1.0 / num_embeddings)
    out = torch.empty(stop - start, dim, dtype=torch.float32)
    block = start // INIT_BLOCK_ROWS
    while block * INIT_BLOCK_ROWS < stop:
        b0 = block * INIT_BLOCK_ROWS
        b1 = min(b0 + INIT_BLOCK_ROWS, num_embeddings)
        gen = torch.Generator().manual_seed(_block_seed(seed, table, block))
        vals = torch.rand(b1 - b0, dim, generator=gen, dtype=torch.float32)
        vals.mul_(2.0 * bound).sub_(bound)
        lo, hi = max(start, b0), min(stop, b1)
        out[lo - start : hi - start] = vals[lo - b0 : hi - b0]
        block += 1
    return out


def init_embedding_weights(
    weight: torch.Tensor,
    table: str,
    seed: int,
    num_embeddings: Optional[int] = None,
    row_offset: int = 0,
    chunk_rows: int = 65536,
) -> torch.Tensor:
    """Write the initial values of a table (or of a row shard of it) into ``weight``, chunk by chunk.

    Use it on a resident model's tables so they start from the same values as a cached run's stores.

    Args:
        weight: (rows, D) float tensor to fill in place (any device).
        table: table name.
        seed: global seed.
        num_embeddings: rows of the whole table; defaults to ``weight.shape[0]``.
        row_offset: index of ``weight``'s first row in the whole table (for row-wise shards).
        chunk_rows: rows generated at a time (bounds host memory).

    Returns:
        ``weight``, filled.

    Raises:
        ConfigError: ``weight`` is not 2-D or the shard does not fit in the table.

    Example:
        >>> w = init_embedding_weights(torch.empty(5, 4), "t0", seed=1)
        >>> torch.equal(w, init_rows(1, "t0", 0, 5, 4, 5))
        True
    """
    if weight.dim() != 2:
        raise ConfigError(
            f"weight for table '{table}' must be 2-D (rows, dim) but has shape {tuple(weight.shape)}"
        )
    rows, dim = int(weight.shape[0]), int(weight.shape[1])
    total = rows if num_embeddings is None else int(num_embeddings)
    if row_offset < 0 or row_offset + rows > total:
        raise ConfigError(
            f"shard of table '{table}' with row_offset={row_offset} and {rows} rows does not fit in "
            f"num_embeddings={total}"
        )
    with torch.no_grad():
        for lo in range(0, rows, chunk_rows):
            hi = min(lo + chunk_rows, rows)
            vals = init_rows(seed, table, row_offset + lo, row_offset + hi, dim, total)
            weight[lo:hi].copy_(vals.to(device=weight.device, dtype=weight.dtype))
    return weight
