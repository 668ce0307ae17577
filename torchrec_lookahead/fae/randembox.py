"""FAE's Rand-Em Box: how many rows of a table reach an access cutoff, from a few random chunks of rows.

For a table of ``N`` rows with sampled access counts ``k``, the box draws ``n`` (35) distinct chunks of ``m``
(1,024) consecutive rows. For a cutoff ``H`` each chunk gives ``y_i`` = rows with ``k >= H`` (FAE, equations
2-3); the mean ``y_bar`` (equation 4) and the sample standard deviation ``s`` give the t-interval

    y_bar +- t_{1 - alpha/2, n - 1} * sqrt((B - n) / B * s^2 / n)        (equation 5)

with ``B = N // m`` chunks in the table (the finite-population correction that FAE's equation 6 drops for
``B >> n``). Scaled by ``N / m`` it bounds the table's hot rows; the calibrator sizes with the upper end.
Each chunk is sorted once, so one estimate costs ``n * log(m)`` comparisons, not a scan of the table.
A table of at most ``n`` chunks is counted exactly instead (the chunks would cover it anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchrec_lookahead.fae._stats import student_t_quantile

__all__ = ["RandEmBox", "RowEstimate"]


@dataclass(frozen=True)
class RowEstimate:
    """Estimated rows of a table at or above a cutoff.

    Attributes:
        estimate: point estimate (``y_bar * N / m``).
        lower: lower end of the t-interval, in rows (>= 0).
        upper: upper end of the t-interval, in rows (<= N); what the calibrator sizes with.
        exact: the table was counted exactly (small enough for the chunks to cover it).
    """

    estimate: float
    lower: int
    upper: int
    exact: bool


class RandEmBox:
    """Estimates of hot rows of one table at any cutoff, from ``num_chunks`` random chunks of its counts.

    Args:
        counts: sampled access count per row (int64, length ``N``).
        num_chunks: chunks drawn (``n``).
        chunk_rows: rows per chunk (``m``).
        confidence: two-sided confidence of the t-interval.
        generator: seeded generator for the chunk draw.

    Example:
        >>> counts = torch.zeros(100_000, dtype=torch.int64); counts[::10] = 5  # 10,000 rows with 5 accesses
        >>> box = RandEmBox(counts, 35, 1024, 0.999, torch.Generator().manual_seed(0))
        >>> est = box.estimate(5)
        >>> est.lower <= 10_000 <= est.upper, box.estimate(6).upper
        (True, 0)
    """

    def __init__(
        self,
        counts: torch.Tensor,
        num_chunks: int,
        chunk_rows: int,
        confidence: float,
        generator: torch.Generator,
    ) -> None:
        self.num_rows = int(counts.numel())
        self.chunk_rows = chunk_rows
        self.num_blocks = self.num_rows // chunk_rows
        self.exact = self.num_blocks <= num_chunks
        if self.exact:
            self._sorted = torch.sort(counts.reshape(1, -1)).values.to(torch.float64)
            self.num_chunks = 1
            self._t = 0.0
        else:
            picks = torch.randperm(self.num_blocks, generator=generator)[:num_chunks]
            blocks = counts[: self.num_blocks * chunk_rows].view(self.num_blocks, chunk_rows)
            self._sorted = torch.sort(blocks.index_select(0, picks), dim=1).values.to(torch.float64)
            self.num_chunks = num_chunks
            self._t = student_t_quantile(1.0 - (1.0 - confidence) / 2.0, num_chunks - 1)

    def chunk_hits(self, cutoff: int) -> torch.Tensor:
        """``y_i``: rows of each drawn chunk with ``count >= cutoff`` (float64, one per chunk)."""
        c = torch.full((self._sorted.shape[0], 1), float(cutoff), dtype=torch.float64)
        below = torch.searchsorted(self._sorted, c, right=False)
        return (self._sorted.shape[1] - below.squeeze(1)).to(torch.float64)

    def estimate(self, cutoff: int) -> RowEstimate:
        """Rows of the table with ``count >= cutoff``: point estimate and t-interval."""
        y = self.chunk_hits(cutoff)
        if self.exact:
            n = int(y[0].item())
            return RowEstimate(float(n), n, n, True)
        mean = float(y.mean())
        s2 = float(y.var(unbiased=True))
        fpc = (self.num_blocks - self.num_chunks) / self.num_blocks
        half = self._t * math.sqrt(max(fpc, 0.0) * s2 / self.num_chunks)
        scale = self.num_rows / self.chunk_rows
        upper = min(self.num_rows, math.ceil((mean + half) * scale - 1e-9))
        lower = max(0, math.floor((mean - half) * scale + 1e-9))
        return RowEstimate(mean * scale, lower, upper, False)
