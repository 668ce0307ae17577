"""torchrec_lookahead: train TorchRec models whose embedding tables exceed device memory, exactly.

Tables live in a host store; a lookahead oracle plans which rows each upcoming batch needs, and a small
device cache holds just those rows, with results equal to resident training.
"""

from torchrec_lookahead.errors import (
    CapacityError,
    CheckpointError,
    ConfigError,
    DataError,
    InvalidIdError,
    LookaheadError,
    SetupError,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "LookaheadError",
    "ConfigError",
    "DataError",
    "InvalidIdError",
    "CapacityError",
    "SetupError",
    "CheckpointError",
]
