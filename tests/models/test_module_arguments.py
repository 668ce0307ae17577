"""Arguments of the bundled LightningModules given as a config would give them (dicts), and paths
``load_from_checkpoint`` cannot read: built or refused at once, with a typed error."""

import os

import pytest

from torchrec_lookahead import CheckpointError, ConfigError
from torchrec_lookahead.models import DLRMModule
from torchrec_lookahead.optim import DenseOptimizerSpec, EmbeddingOptimizerSpec

SIZES = {"cat_0": 10, "cat_1": 5}


def _model(**kw):
    return DLRMModule(
        SIZES, 2, embedding_dim=4, dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[4, 1], **kw
    )


def test_optimizer_dicts_are_built_into_the_specs_a_config_builds():
    m = _model(
        embedding_optimizer={"name": "adam", "lr": 0.1, "betas": (0.8, 0.9)},
        dense_optimizer={"name": "sgd", "lr": 0.2, "kwargs": {"momentum": 0.5}},
    )
    assert m.embedding_optimizer == EmbeddingOptimizerSpec("adam", lr=0.1, betas=(0.8, 0.9))
    assert m.dense_optimizer == DenseOptimizerSpec("sgd", lr=0.2, kwargs={"momentum": 0.5})
    # the typed objects and the defaults are kept as they are
    spec = EmbeddingOptimizerSpec("sgd", lr=0.3)
    assert _model(embedding_optimizer=spec).embedding_optimizer is spec
    assert _model().dense_optimizer == DenseOptimizerSpec()


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            {"embedding_optimizer": {"name": "sgd", "learning_rate": 0.1}},
            r"embedding_optimizer has unknown keys \['learning_rate'\]; its keys are \['name', 'lr', 'eps'",
        ),
        (
            {"dense_optimizer": {"nme": "sgd"}},
            r"dense_optimizer has unknown keys \['nme'\]; its keys are \['name'",
        ),
        (
            {"dense_optimizer": {"name": "sgd", "lr": "0.1"}},
            r"dense_optimizer lr must be a number but got '0.1'",
        ),
        (
            {"embedding_optimizer": {"name": "adamw"}},
            r"embedding_optimizer: Expected embedding optimizer to be one",
        ),
        (
            {"embedding_optimizer": "sgd"},
            r"embedding_optimizer must be EmbeddingOptimizerSpec\(...\) or a dict of its",
        ),
    ],
)
def test_optimizer_dicts_that_build_no_spec_are_refused_naming_the_keys(kw, match):
    with pytest.raises(ConfigError, match=match):
        _model(**kw)


def test_load_from_checkpoint_of_a_sharded_directory_points_to_export(tmp_path):
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(b"")  # torch.distributed.checkpoint's, as strategy='torchrec' writes it
    with pytest.raises(
        CheckpointError, match=r"sharded checkpoint directory.*python -m torchrec_lookahead export"
    ):
        DLRMModule.load_from_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=r"a directory, not a checkpoint file.*ckpt_path"):
        DLRMModule.load_from_checkpoint(str(tmp_path))
    # a file is Lightning's to read
    with pytest.raises(FileNotFoundError):
        DLRMModule.load_from_checkpoint(os.path.join(tmp_path, "missing.ckpt"))
