import lightning.pytorch as pl
import pytest
import torch

from torchrec_lookahead import ConfigError
from torchrec_lookahead.data import CriteoSyntheticDataModule
from torchrec_lookahead.models import DLRMModule
from torchrec_lookahead.optim import DenseOptimizerSpec, EmbeddingOptimizerSpec

from ..helpers import make_model


def test_bad_architecture_and_optimizer_names_are_refused():
    sizes = {"cat_0": 10}
    with pytest.raises(ConfigError, match="embedding_dim"):
        DLRMModule(sizes, 2, embedding_dim=8, dense_arch_layer_sizes=[16, 4])
    with pytest.raises(ConfigError, match="must be 1"):
        DLRMModule(sizes, 2, embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[8, 2])
    with pytest.raises(ConfigError, match="positive integer"):
        DLRMModule({"cat_0": 0}, 2)
    with pytest.raises(ConfigError, match="required"):
        DLRMModule(None, 2)
    with pytest.raises(ConfigError, match=r"one of \['sgd', 'rowwise_adagrad', 'adagrad', 'adam'\]"):
        EmbeddingOptimizerSpec("adamw")
    with pytest.raises(ConfigError, match="learning rate"):
        DenseOptimizerSpec("sgd", lr=0)


def test_embedding_optimizer_maps_to_fbgemm_names():
    spec = EmbeddingOptimizerSpec("adam", lr=0.1, betas=(0.8, 0.9))
    assert spec.optimizer_kwargs() == {
        "lr": 0.1,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "beta1": 0.8,
        "beta2": 0.9,
    }
    assert isinstance(spec.build_unfused([torch.nn.Parameter(torch.zeros(2))]), torch.optim.Adam)


@pytest.mark.slow
def test_synthetic_labels_are_learnable(tmp_path):
    """A short fit lifts validation AUC clearly above chance: the labels come from a learnable hidden model."""
    pl.seed_everything(0, verbose=False)
    dm = CriteoSyntheticDataModule(
        batch_size=512, num_train_batches=80, num_val_batches=8, num_embeddings=[2000] * 26, seed=1
    )
    model = make_model(dm)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="torchrec",
        max_epochs=1,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        num_sanity_val_steps=0,
    )
    before = trainer.validate(model, datamodule=dm, verbose=False)[0]["val/auc"]
    trainer.fit(model, datamodule=dm)
    after = trainer.validate(model, datamodule=dm, verbose=False)[0]["val/auc"]
    assert after > 0.65 and after > before + 0.1, (before, after)
