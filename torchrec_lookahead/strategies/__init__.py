"""Lightning strategies. Importing this package registers ``strategy="torchrec"``."""

from torchrec_lookahead.strategies.torchrec import TorchRecStrategy

__all__ = ["TorchRecStrategy"]
