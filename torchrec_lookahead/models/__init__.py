"""LightningModules around TorchRec models: DLRM, DCN-v2 (``DLRM_DCN``), DeepFM (``SimpleDeepFMNN``) and a
sequence model over an ``EmbeddingCollection`` history (:class:`SequenceModule`), all
:class:`TorchRecModule` subclasses, which the CLI and ``verify`` take."""

from torchrec_lookahead.models.base import TorchRecModule, embedding_modules, make_table_configs
from torchrec_lookahead.models.dcn import DCNModule
from torchrec_lookahead.models.deepfm import DeepFMModule
from torchrec_lookahead.models.dlrm import DLRMModule
from torchrec_lookahead.models.sequence import SequenceModule

__all__ = [
    "TorchRecModule",
    "DLRMModule",
    "DCNModule",
    "DeepFMModule",
    "SequenceModule",
    "embedding_modules",
    "make_table_configs",
]
