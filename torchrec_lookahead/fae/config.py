"""The calibrator's configuration: the hot budget and FAE's sampling and estimation knobs."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional

from torchrec_lookahead._checks import is_int
from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.optim import EmbeddingOptimizerName

__all__ = ["CalibrationConfig", "optimizer_state_floats"]

_MIB = 1 << 20


def optimizer_state_floats(optimizer: str, embedding_dim: int) -> int:
    """float32 optimizer-state values kept per embedding row (FBGEMM's layout).

    Example:
        >>> optimizer_state_floats("rowwise_adagrad", 16), optimizer_state_floats("adam", 16)
        (1, 32)
    """
    try:
        name = EmbeddingOptimizerName(optimizer)
    except ValueError:
        valid = [m.value for m in EmbeddingOptimizerName]
        raise ConfigError(f"Expected optimizer to be one of {valid} but got {optimizer!r}") from None
    return {
        EmbeddingOptimizerName.SGD: 0,
        EmbeddingOptimizerName.ROWWISE_ADAGRAD: 1,
        EmbeddingOptimizerName.ADAGRAD: embedding_dim,
        EmbeddingOptimizerName.ADAM: 2 * embedding_dim,
    }[name]


def _real(value: object) -> bool:
    """``value`` is a real number, not a ``bool`` (NaN passes: the range checks refuse it)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class CalibrationConfig:
    """What the calibrator may spend and how it samples.

    Args:
        hot_budget_bytes: bytes every rank may give the hot rows (weights plus optimizer state; the hot set is
            replicated on every rank, so this is the per-rank cost). FAE uses 256 MiB.
        sample_fraction: share of the training batches sampled for access counts, in (0, 1] (FAE: 5 %).
        num_chunks: Rand-Em Box chunks drawn per table (FAE: 35, enough for the central limit theorem).
        chunk_rows: rows per chunk (FAE: 1,024).
        box_tolerance: the Rand-Em Box draws more chunks (doubling, along the same random block order) while
            its t-interval's half-width exceeds this share of the estimate: where hot rows are rare, FAE's 35
            chunks may see none of them. ``None`` keeps FAE's fixed ``num_chunks``.
        box_max_share: the most chunks the box grows to, as a share of a table's chunks (the box's cost bound;
            the 0.25 default keeps the sampled totals within 10 % of the exact hot-row counts on Criteo-shaped
            tables, where 35 chunks were off by up to 55 %).
        confidence: two-sided confidence of the t-interval; the hot set is sized with its upper bound.
        small_table_bytes: tables whose weights are smaller than this are wholly hot (FAE: 1 MiB).
        seed: seed of the batch sample and of the chunk draw.
        embedding_dim: embedding width (float32 weights).
        optimizer: embedding optimizer name (its per-row state counts against the budget).
        search_steps: bisection steps of the statistical optimizer over log(threshold).

    Example:
        >>> CalibrationConfig(hot_budget_bytes=1 << 20, embedding_dim=16).row_bytes
        68
    """

    hot_budget_bytes: int
    sample_fraction: float = 0.05
    num_chunks: int = 35
    chunk_rows: int = 1024
    box_tolerance: Optional[float] = 0.1
    box_max_share: float = 0.25
    confidence: float = 0.999
    small_table_bytes: int = _MIB
    seed: int = 0
    embedding_dim: int = 16
    optimizer: str = "rowwise_adagrad"
    search_steps: int = 60

    def __post_init__(self) -> None:
        if isinstance(self.hot_budget_bytes, bool) or not isinstance(self.hot_budget_bytes, int):
            raise ConfigError(
                f"Expected hot_budget_bytes to be a positive integer but got {self.hot_budget_bytes!r}"
            )
        if self.hot_budget_bytes <= 0:
            raise ConfigError(
                f"Expected hot_budget_bytes > 0 but got {self.hot_budget_bytes}; give the hot rows a memory "
                "budget per rank (FAE uses 256 MiB = 268435456)"
            )
        if not _real(self.sample_fraction) or not 0.0 < float(self.sample_fraction) <= 1.0:
            raise ConfigError(
                f"Expected sample_fraction in (0, 1] but got {self.sample_fraction!r}; e.g. 0.05 samples 5 % "
                "of the training batches"
            )
        if not is_int(self.num_chunks) or self.num_chunks < 2:
            raise ConfigError(
                f"Expected num_chunks to be an integer >= 2 (a t-interval needs two chunks) but got "
                f"{self.num_chunks!r}"
            )
        if not is_int(self.chunk_rows) or self.chunk_rows < 1:
            raise ConfigError(f"Expected chunk_rows to be a positive integer but got {self.chunk_rows!r}")
        if self.box_tolerance is not None and (
            isinstance(self.box_tolerance, bool)
            or not isinstance(self.box_tolerance, (int, float))
            or not self.box_tolerance > 0
        ):
            raise ConfigError(
                f"Expected box_tolerance > 0 (a share of the estimate, e.g. 0.1) or None (FAE's fixed chunks) but "
                f"got {self.box_tolerance!r}"
            )
        if (
            isinstance(self.box_max_share, bool)
            or not isinstance(self.box_max_share, (int, float))
            or not 0.0 < self.box_max_share <= 1.0
        ):
            raise ConfigError(
                f"Expected box_max_share in (0, 1] (the most of a table the Rand-Em Box draws) but got "
                f"{self.box_max_share!r}"
            )
        if not _real(self.confidence) or not 0.5 <= float(self.confidence) < 1.0:
            raise ConfigError(f"Expected confidence in [0.5, 1) but got {self.confidence!r}; FAE uses 0.999")
        if not is_int(self.small_table_bytes) or self.small_table_bytes < 0:
            raise ConfigError(
                f"Expected small_table_bytes to be an integer >= 0 but got {self.small_table_bytes!r}"
            )
        if not is_int(self.embedding_dim) or self.embedding_dim < 1:
            raise ConfigError(
                f"Expected embedding_dim to be a positive integer but got {self.embedding_dim!r}"
            )
        if not is_int(self.seed):
            raise ConfigError(f"Expected the calibration seed to be an integer but got {self.seed!r}")
        if not is_int(self.search_steps) or self.search_steps < 1:
            raise ConfigError(f"Expected search_steps to be an integer >= 1 but got {self.search_steps!r}")
        optimizer_state_floats(self.optimizer, self.embedding_dim)

    @property
    def row_bytes(self) -> int:
        """Bytes of one hot row: float32 weights plus the optimizer's per-row state."""
        return 4 * (self.embedding_dim + optimizer_state_floats(self.optimizer, self.embedding_dim))

    @property
    def weight_bytes(self) -> int:
        """Bytes of one row's weights (what decides whether a table is small)."""
        return 4 * self.embedding_dim
