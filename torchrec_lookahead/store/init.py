"""Deterministic initial embedding values, shared by the stores and by resident models.

The initial value of row ``r``, column ``c`` of table ``table`` is a counter-based draw: a stable hash of
``(seed, table)`` keys a SplitMix64 mix of the counter ``(r, c // 2)``, whose 64 bits give the two columns of a pair
24 bits each, scaled to ``uniform(-sqrt(1/N), sqrt(1/N))``, TorchRec's default ``EmbeddingBagConfig``
initialisation. So the value of a row depends only on the seed, the table name, the table size, the width and
the row index, never on how a caller chunks its initialisation, and any single row is computed without the rows
around it: a disk store computes a row that was never written instead of reading it, a memory-mapped store
initialises lazily chunk by chunk, and an in-RAM store and a resident TorchRec table initialised with
:func:`init_embedding_weights` hold the same numbers bit for bit. Integer arithmetic is exact and the scaling is
one float32 multiply and subtract, so the values are the same on every platform.

Example:
    >>> import numpy as np, torch
    >>> a = init_rows(seed=0, table="t0", start=0, stop=10, dim=4, num_embeddings=100)
    >>> b = torch.cat([init_rows(0, "t0", 0, 3, 4, 100), init_rows(0, "t0", 3, 10, 4, 100)])
    >>> c = init_rows_at(0, "t0", np.array([7, 2]), 4, 100)
    >>> torch.equal(a, b), bool(a.abs().max() <= 0.1), np.array_equal(c, a[[7, 2]].numpy())
    (True, True, True)
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional

import numpy as np
import torch

from torchrec_lookahead.errors import ConfigError

__all__ = ["INIT_BLOCK_ROWS", "init_rows", "init_rows_at", "init_embedding_weights"]

INIT_BLOCK_ROWS: int = 8192
"""Rows a lazily initialised store initialises at a time, and the rows of a disk store's file block; the initial
values do not depend on it."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_LOW24 = np.uint64(0xFFFFFF)
_SHIFTS = tuple(np.uint64(s) for s in (30, 27, 31, 40, 8))


def _table_key(seed: int, table: str) -> np.uint64:
    digest = hashlib.blake2b(f"{seed}/{table}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def _check(table: str, rows_ok: bool, dim: int, expected: str, detail: str) -> None:
    if not rows_ok or dim <= 0:
        raise ConfigError(
            f"init_rows for table '{table}': expected {expected} and dim > 0 but got {detail}, dim={dim}"
        )


def init_rows_at(seed: int, table: str, rows: np.ndarray, dim: int, num_embeddings: int) -> np.ndarray:
    """Initial weights of the given rows of a table, each computed on its own.

    Args:
        seed: global seed of the run.
        table: table name (different tables get independent values).
        rows: (n,) integer array of row indices (any order, repeats allowed).
        dim: embedding dimension.
        num_embeddings: rows of the whole table (sets the bound ``sqrt(1/num_embeddings)``).

    Returns:
        (n, dim) float32 array: row ``i`` is row ``rows[i]`` of :func:`init_rows`.

    Raises:
        ConfigError: a row is outside ``[0, num_embeddings)``, or ``dim <= 0``.
    """
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size:
        lo, hi = int(rows.min()), int(rows.max())
        ok, detail = 0 <= lo and hi < num_embeddings, f"rows {lo}..{hi}, num_embeddings={num_embeddings}"
    else:
        ok, detail = True, "no rows"
    _check(table, ok, dim, "0 <= rows < num_embeddings", detail)
    s30, s27, s31, s40, s8 = _SHIFTS
    pairs = (dim + 1) // 2
    z = rows.astype(np.uint64)[:, None] * np.uint64(pairs) + np.arange(1, pairs + 1, dtype=np.uint64)[None, :]
    np.multiply(z, _GOLDEN, out=z)
    np.add(z, _table_key(seed, table), out=z)
    t = np.right_shift(z, s30)
    np.bitwise_xor(z, t, out=z)
    np.multiply(z, _MIX1, out=z)
    np.right_shift(z, s27, out=t)
    np.bitwise_xor(z, t, out=z)
    np.multiply(z, _MIX2, out=z)
    np.right_shift(z, s31, out=t)
    np.bitwise_xor(z, t, out=z)
    out = np.empty((rows.size, 2 * pairs), dtype=np.float32)
    np.right_shift(z, s40, out=t)
    out[:, 0::2] = t
    np.right_shift(z, s8, out=t)
    np.bitwise_and(t, _LOW24, out=t)
    out[:, 1::2] = t
    if dim % 2:
        out = np.ascontiguousarray(out[:, :dim])
    bound = math.sqrt(1.0 / num_embeddings)
    out *= np.float32(2.0**-24)  # exact: a 24-bit integer times a power of two, in [0, 1)
    out *= np.float32(2.0 * bound)
    out -= np.float32(bound)
    return out


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
    _check(
        table,
        0 <= start <= stop <= num_embeddings,
        dim,
        "0 <= start <= stop <= num_embeddings",
        f"start={start}, stop={stop}, num_embeddings={num_embeddings}",
    )
    out = np.empty((stop - start, dim), dtype=np.float32)
    for lo in range(start, stop, INIT_BLOCK_ROWS):  # bounded temporaries
        hi = min(lo + INIT_BLOCK_ROWS, stop)
        out[lo - start : hi - start] = init_rows_at(seed, table, np.arange(lo, hi), dim, num_embeddings)
    return torch.from_numpy(out)


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
