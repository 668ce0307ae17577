"""torchrec_lookahead: train TorchRec models whose embedding tables exceed device memory, exactly.

Tables live in a host store; a lookahead oracle plans which rows each upcoming batch needs, and a small
device cache holds just those rows, with results equal to resident training.
"""

from typing import TYPE_CHECKING, Any

from torchrec_lookahead import _compat
from torchrec_lookahead.errors import (
    CapacityError,
    CheckpointError,
    ConfigError,
    DataError,
    InvalidIdError,
    LookaheadError,
    SetupError,
    StoreError,
)

if TYPE_CHECKING:
    from torchrec_lookahead._rng import preserved_rng
    from torchrec_lookahead.train_pipeline import LookaheadTrainPipeline

__version__ = "0.1.0"

_compat.install()  # before anything imports FBGEMM

__all__ = [
    "__version__",
    "LookaheadError",
    "ConfigError",
    "DataError",
    "InvalidIdError",
    "CapacityError",
    "SetupError",
    "CheckpointError",
    "StoreError",
    "LookaheadTrainPipeline",
    "preserved_rng",
]


def __getattr__(name: str) -> Any:
    # Imported on first use: the package's import stays light (no TorchRec) for the error types and the CLI.
    if name == "LookaheadTrainPipeline":
        from torchrec_lookahead.train_pipeline import LookaheadTrainPipeline

        return LookaheadTrainPipeline
    if name == "preserved_rng":
        from torchrec_lookahead._rng import preserved_rng

        return preserved_rng
    raise AttributeError(f"module 'torchrec_lookahead' has no attribute {name!r}")
