"""FAE's Rand-Em Box: how many rows of a table reach an access cutoff, from random chunks of rows.

For a table of ``N`` rows with sampled access counts ``k``, the box draws ``n`` (35) distinct chunks of ``m``
(1,024) consecutive rows. For a cutoff ``H`` each chunk gives ``y_i`` = rows with ``k >= H`` (FAE, equations
2-3); the mean ``y_bar`` (equation 4) and the sample standard deviation ``s`` give the t-interval

    y_bar +- t_{1 - alpha/2, n - 1} * sqrt((B - n) / B * s^2 / n)        (equation 5)

with ``B = N // m`` chunks in the table (the finite-population correction that FAE's equation 6 drops for
``B >> n``). Scaled by ``N / m`` it bounds the table's hot rows; the calibrator sizes with the upper end.

*Growing the box.* 35 chunks are plenty where the hot rows are many, and far too few where they are rare: at a
high cutoff a table of millions of rows may hold a hundred hot rows, so that 35 chunks (0.35 % of a 10 M-row
table) see none or one of them, and the estimate is off by tens of percent. With ``tolerance`` set, the chunks
are taken further along the same random block order, doubling (``n``, ``2n``, ``4n``, ...), until the
t-interval's half-width is at most ``tolerance`` times the estimate or ``max_share`` of the table's blocks are
drawn. The chunk set used at a cutoff is the first one of that sequence that meets the target, so an estimate
is a function of the cutoff alone (not of the order of the calls), and the first ``n`` chunks are FAE's box.
Grown over every chunk (``max_share`` 1), the box adds the rows past the last whole chunk and counts exactly.
Only the rows with a non-zero count are kept of each drawn chunk (a cutoff of at least 1 never counts the
others), so an estimate costs a pass over the sampled accesses of the drawn chunks, not a scan of the table.
A table of at most ``n`` chunks is counted exactly instead (the chunks would cover it anyway).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from torchrec_lookahead.fae._stats import student_t_quantile

__all__ = ["RandEmBox", "RowEstimate"]


@functools.lru_cache(maxsize=256)
def _two_sided_t(confidence: float, df: int) -> float:
    """The t quantile of a two-sided ``confidence`` interval (shared by every box: each chunk count of the
    doubling sequence needs one)."""
    return student_t_quantile(1.0 - (1.0 - confidence) / 2.0, df)


@dataclass(frozen=True)
class RowEstimate:
    """Estimated rows of a table at or above a cutoff.

    Attributes:
        estimate: point estimate (``y_bar * N / m``).
        lower: lower end of the t-interval, in rows (>= 0).
        upper: upper end of the t-interval, in rows (<= N); what the calibrator sizes with.
        exact: the table was counted exactly (small enough for the chunks to cover it, or grown over all).
        chunks: chunks the estimate used (1 when exact).
    """

    estimate: float
    lower: int
    upper: int
    exact: bool
    chunks: int = 0


class RandEmBox:
    """Estimates of hot rows of one table at any cutoff, from random chunks of its counts.

    Args:
        counts: sampled access count per row (int64, length ``N``; read again as the box grows, so not to be
            changed while the box is in use).
        num_chunks: chunks drawn first (``n``; FAE's box).
        chunk_rows: rows per chunk (``m``).
        confidence: two-sided confidence of the t-interval.
        generator: seeded generator for the chunk draw (one random order of the table's blocks).
        tolerance: grow the chunk set (doubling, along the same block order) while the t-interval's half-width
            exceeds this share of the estimate; ``None`` keeps FAE's fixed ``n`` chunks.
        max_share: the most chunks drawn, as a share of the table's blocks (at least ``n``).

    Example:
        >>> counts = torch.zeros(100_000, dtype=torch.int64); counts[::10] = 5  # 10,000 rows with 5 accesses
        >>> box = RandEmBox(counts, 35, 1024, 0.999, torch.Generator().manual_seed(0))
        >>> est = box.estimate(5)
        >>> est.lower <= 10_000 <= est.upper, box.estimate(6).upper
        (True, 0)
        >>> rare = torch.zeros(100_000, dtype=torch.int64); rare[::9973] = 9  # 11 hot rows in 97 chunks
        >>> fixed = RandEmBox(rare, 35, 1024, 0.999, torch.Generator().manual_seed(0))
        >>> grown = RandEmBox(rare, 35, 1024, 0.999, torch.Generator().manual_seed(0), 0.1, 1.0)
        >>> [(e.chunks, round(e.estimate), e.exact) for e in (fixed.estimate(9), grown.estimate(9))]
        [(35, 3, False), (97, 11, True)]
    """

    def __init__(
        self,
        counts: torch.Tensor,
        num_chunks: int,
        chunk_rows: int,
        confidence: float,
        generator: torch.Generator,
        tolerance: Optional[float] = None,
        max_share: float = 1.0,
    ) -> None:
        self.num_rows = int(counts.numel())
        self.chunk_rows = chunk_rows
        self.num_blocks = self.num_rows // chunk_rows
        self.exact = self.num_blocks <= num_chunks
        self.tolerance = tolerance
        self.confidence = confidence
        self.num_chunks = 1 if self.exact else num_chunks
        self.max_chunks = self.num_chunks
        if tolerance is not None and not self.exact:
            self.max_chunks = min(self.num_blocks, max(num_chunks, math.ceil(max_share * self.num_blocks)))
        self._counts = counts
        self._drawn = 0
        self._memo: Dict[int, RowEstimate] = {}
        if self.exact:
            nonzero = counts[counts > 0]
            self._values = nonzero
            self._chunk = torch.zeros(nonzero.numel(), dtype=torch.int64)
            self._drawn = 1
        else:
            self._picks = torch.randperm(self.num_blocks, generator=generator)
            self._values = torch.empty(0, dtype=torch.int64)
            self._chunk = torch.empty(0, dtype=torch.int64)
            self._draw(self.num_chunks)

    def _draw(self, n: int) -> None:
        """Keep the non-zero counts of the first ``n`` blocks of the random order (and their chunk index)."""
        if n <= self._drawn:
            return
        m = self.chunk_rows
        blocks = self._counts[: self.num_blocks * m].view(self.num_blocks, m)
        rows = blocks.index_select(0, self._picks[self._drawn : n])
        where = torch.nonzero(rows > 0)
        self._values = torch.cat([self._values, rows[where[:, 0], where[:, 1]]])
        self._chunk = torch.cat([self._chunk, where[:, 0] + self._drawn])
        self._drawn = n

    def _quantile(self, n: int) -> float:
        return _two_sided_t(self.confidence, n - 1)

    def chunk_hits(self, cutoff: int, chunks: Optional[int] = None) -> torch.Tensor:
        """``y_i``: rows of each of the first ``chunks`` (default ``n``) drawn chunks with ``count >= cutoff``
        (float64, one per chunk)."""
        n = self.num_chunks if chunks is None else min(chunks, self.max_chunks)
        self._draw(n)
        if cutoff <= 0:
            width = self.num_rows if self.exact else self.chunk_rows
            return torch.full((n,), float(width), dtype=torch.float64)
        keep = self._values >= cutoff
        if n < self._drawn:
            keep &= self._chunk < n
        return torch.bincount(self._chunk[keep], minlength=n).to(torch.float64)

    def _interval(self, n: int, s1: float, s2: float) -> Tuple[float, float]:
        """Mean and t-interval half-width of ``n`` chunks whose hits sum to ``s1`` and squares to ``s2``."""
        mean = s1 / n
        var = max(0.0, (s2 - s1 * s1 / n) / (n - 1))
        fpc = (self.num_blocks - n) / self.num_blocks
        return mean, self._quantile(n) * math.sqrt(max(fpc, 0.0) * var / n)

    def _grown(self, cutoff: int) -> Tuple[int, float, float]:
        """Chunks, mean and half-width at ``cutoff``: the first of ``n, 2n, 4n, ...`` (up to the cap) whose
        interval is within the tolerance."""
        n, tol = self.num_chunks, self.tolerance or 0.0  # without a tolerance the cap is n itself
        while True:
            steps = [n]  # the chunk counts of the sequence that are drawn already
            while steps[-1] < min(self.max_chunks, self._drawn):
                steps.append(min(self.max_chunks, 2 * steps[-1]))
            steps = [k for k in steps if k <= self._drawn]
            y = self.chunk_hits(cutoff, self._drawn)
            at = torch.tensor([k - 1 for k in steps])
            sums, squares = torch.stack([y, y * y]).cumsum(1)[:, at].tolist()
            for k, s1, s2 in zip(steps, sums, squares):
                mean, half = self._interval(k, s1, s2)
                if k >= self.max_chunks or 0 < half <= tol * mean or (mean > 0 and half == 0):
                    return k, mean, half  # (half == 0 < mean: every chunk alike, more would not tell more)
            n = min(self.max_chunks, 2 * steps[-1])
            self._draw(n)

    def estimate(self, cutoff: int) -> RowEstimate:
        """Rows of the table with ``count >= cutoff``: point estimate and t-interval."""
        if cutoff in self._memo:
            return self._memo[cutoff]
        if self.exact:
            k = int(self.chunk_hits(cutoff)[0].item())
            est = RowEstimate(float(k), k, k, True, 1)
        else:
            n, mean, half = self._grown(cutoff)
            if (
                n == self.num_blocks
            ):  # grown over every chunk: add the rows past the last one, and it is a count
                tail = self._counts[self.num_blocks * self.chunk_rows :]
                k = round(mean * n) + int((tail >= max(cutoff, 0)).sum())
                est = RowEstimate(float(k), k, k, True, n)
            else:
                scale = self.num_rows / self.chunk_rows
                upper = min(self.num_rows, math.ceil((mean + half) * scale - 1e-9))
                lower = max(0, math.floor((mean - half) * scale + 1e-9))
                est = RowEstimate(mean * scale, lower, upper, False, n)
        self._memo[cutoff] = est
        return est
