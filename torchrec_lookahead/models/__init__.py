"""LightningModules around TorchRec models: DLRM, DCN-v2 (``DLRM_DCN``) and DeepFM (``SimpleDeepFMNN``), all
:class:`TorchRecModule` subclasses, which the CLI and ``verify`` take."""

from torchrec_lookahead.models.base import TorchRecModule, embedding_modules, table_configs
from torchrec_lookahead.models.dcn import DCNModule
from torchrec_lookahead.models.deepfm import DeepFMModule
from torchrec_lookahead.models.dlrm import DLRMModule

__all__ = ["TorchRecModule", "DLRMModule", "DCNModule", "DeepFMModule", "embedding_modules", "table_configs"]
