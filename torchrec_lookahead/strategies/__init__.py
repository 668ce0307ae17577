"""Lightning strategies. Importing this package registers ``strategy="torchrec"`` and
``strategy="hierarchical"``."""

from torchrec_lookahead.strategies.hierarchical import HierarchicalStrategy
from torchrec_lookahead.strategies.torchrec import TorchRecStrategy

__all__ = ["HierarchicalStrategy", "TorchRecStrategy"]
