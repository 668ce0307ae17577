"""LightningModules around TorchRec models."""

from torchrec_lookahead.models.dlrm import DLRMModule, table_configs

__all__ = ["DLRMModule", "table_configs"]
