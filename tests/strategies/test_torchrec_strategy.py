import os

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torchrec.distributed import DistributedModelParallel

from torchrec_lookahead import CheckpointError, ConfigError, SetupError
from torchrec_lookahead.strategies import TorchRecStrategy

from ..helpers import fit, fit_cached, local_state, max_abs_diff


def test_registered_and_model_sharded_without_ddp_around_the_module(tmp_path):
    trainer, model = fit(tmp_path, max_steps=2)
    assert isinstance(trainer.strategy, TorchRecStrategy)
    assert isinstance(model.model, DistributedModelParallel)
    assert trainer.strategy.model is model  # the LightningModule itself is not wrapped in DDP
    plan = str(model.model.plan)
    assert "fused" in plan and "table_wise" in plan


def test_training_changes_weights_and_loss_is_finite(tmp_path):
    _, m0 = fit(tmp_path / "a", max_steps=1)
    _, m1 = fit(tmp_path / "b", max_steps=6)
    assert max_abs_diff(local_state(m0.model), local_state(m1.model)) > 0


@pytest.mark.parametrize("emb", ["rowwise_adagrad", "sgd"])
def test_mid_epoch_checkpoint_resumes_the_same_trajectory(tmp_path, emb):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    _, full = fit(tmp_path / "full", max_steps=9, callbacks=[ckpt], emb=emb)
    path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    assert path.is_dir() and (path / "meta.pt").is_file() and (path / ".metadata").is_file()
    trainer, resumed = fit(tmp_path / "resumed", max_steps=9, ckpt_path=str(path), emb=emb)
    assert trainer.global_step == 9
    assert max_abs_diff(local_state(full.model), local_state(resumed.model)) == 0.0


def test_resume_across_an_epoch_boundary(tmp_path):
    # 12 batches per epoch: checkpoint at step 8, resume and train into the second epoch.
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=8, save_top_k=-1)
    _, full = fit(tmp_path / "full", max_steps=15, callbacks=[ckpt])
    _, resumed = fit(tmp_path / "r", max_steps=15, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=8.ckpt"))
    assert max_abs_diff(local_state(full.model), local_state(resumed.model)) == 0.0


def test_adam_on_cpu_fused_kernel_is_refused_clearly(tmp_path):
    with pytest.raises(ConfigError, match="not available in FBGEMM's fused kernel on CPU"):
        fit(tmp_path, max_steps=1, emb="adam")
    # some tables resident: refused for a resident one, not a cached one
    with pytest.raises(ConfigError, match=r"parameter 'embedding_bags\.t_cat_0\.weight' is not available"):
        fit_cached(tmp_path / "some", 1, emb="adam")


def test_adam_on_the_cpu_trains_when_every_table_is_cached(tmp_path):
    """The check of FBGEMM's CPU optimizers looked at every table, the cached ones too (which the cache's kernel
    trains, Adam included): a job whose every table is cached was refused."""
    from torchrec_lookahead.data import CriteoSyntheticDataModule

    from ..helpers import tiny_data_args

    rows = CriteoSyntheticDataModule(**tiny_data_args()).num_embeddings_per_feature
    capacity = {f"t_{f}": (n if n < 100 else n // 2) for f, n in rows.items()}
    trainer, _ = fit_cached(tmp_path, 3, capacity=capacity, emb="adam")
    assert trainer.global_step == 3


def test_plain_file_is_not_a_sharded_checkpoint(tmp_path):
    bogus = tmp_path / "x.ckpt"
    bogus.mkdir()
    with pytest.raises(CheckpointError, match="not a checkpoint written by TorchRecStrategy"):
        fit(tmp_path, max_steps=2, ckpt_path=str(bogus))


def test_an_ordinary_checkpoint_file_is_refused_with_the_strategy_that_reads_it(tmp_path):
    exported = tmp_path / "dlrm.ckpt"  # what `export` writes: one Lightning checkpoint of the resident model
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 2}, exported)
    with pytest.raises(CheckpointError, match=r"is a checkpoint file.*run with --trainer.strategy=auto"):
        fit(tmp_path, max_steps=2, ckpt_path=str(exported))


def test_refuses_device_count_that_does_not_match_the_launcher(monkeypatch):
    strategy = TorchRecStrategy(parallel_devices=[torch.device("cpu")])
    strategy._num_nodes = 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SetupError, match="devices=2"):
        strategy._check_launcher()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    strategy._check_launcher()


def test_a_trainer_built_under_torchrun_with_another_device_count_is_refused(monkeypatch):
    """What torchrun --nproc_per_node=2 sets for each rank of a Trainer configured with devices=1: refused when the
    Trainer is built, before any process group exists, naming the setting to change."""
    import lightning.pytorch as pl

    for key, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
                       "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    with pytest.raises(SetupError, match="WORLD_SIZE=2 processes.*Set devices=2"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=TorchRecStrategy(), logger=False)


def test_unknown_module_name_is_refused(tmp_path):
    with pytest.raises(Exception, match="module_name"):
        fit(tmp_path, max_steps=1, strategy=TorchRecStrategy(module_name="net"))


def test_validate_and_test_shard_the_model_too(tmp_path):
    trainer, model = fit(tmp_path, max_steps=2, limit_val_batches=2)
    out = trainer.validate(model, datamodule=trainer.datamodule)
    assert 0.0 <= out[0]["val/auc"] <= 1.0
    out = trainer.test(model, datamodule=trainer.datamodule)
    assert "test/logloss" in out[0]


@pytest.mark.skipif(os.environ.get("WORLD_SIZE") is not None, reason="must not run under a launcher")
def test_unsharded_fallback_trains_with_plain_optimizers(tmp_path):
    trainer, model = fit(tmp_path, max_steps=3, strategy="auto")
    assert not isinstance(model.model, DistributedModelParallel)
    assert trainer.global_step == 3
    assert torch.isfinite(trainer.callback_metrics["train/loss"])  # trained through the plain optimizers


def test_damaged_or_mismatched_checkpoints_are_refused_with_what_to_do(tmp_path):
    import shutil

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    fit(tmp_path / "full", max_steps=2, callbacks=[ckpt])
    good = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"

    def broken(name: str) -> str:
        copy = tmp_path / name
        shutil.copytree(good, copy)
        return str(copy)

    with pytest.raises(CheckpointError, match=r"does not exist; check ckpt_path"):
        fit(tmp_path / "r0", max_steps=3, ckpt_path=str(tmp_path / "nowhere.ckpt"))
    no_metadata = broken("no_metadata")
    os.remove(os.path.join(no_metadata, ".metadata"))
    with pytest.raises(
        CheckpointError, match=r"incomplete: torch.distributed.checkpoint's .metadata file is missing"
    ):
        fit(tmp_path / "r1", max_steps=3, ckpt_path=no_metadata)
    truncated = broken("truncated")
    shard = next(p for p in os.listdir(truncated) if p.endswith(".distcp"))
    with open(os.path.join(truncated, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(truncated, shard)) // 2)
    with pytest.raises(CheckpointError, match=r"could not be read \(EOFError.*damaged or incomplete"):
        fit(tmp_path / "r2", max_steps=3, ckpt_path=truncated)
    # an intact checkpoint of resident tables, resumed with cached ones: another layout, not damage
    with pytest.raises(
        CheckpointError, match=r"holds other tensors than this run's model .* another configuration"
    ):
        fit_cached(tmp_path / "r3", max_steps=3, ckpt_path=broken("resident_into_cached"))
    # the world size is recorded: a checkpoint of another number of ranks is refused before anything is read
    other = broken("two_ranks")
    meta = torch.load(os.path.join(other, "meta.pt"), weights_only=False)
    assert meta["torchrec_lookahead_world_size"] == 1
    meta["torchrec_lookahead_world_size"] = 2
    torch.save(meta, os.path.join(other, "meta.pt"))
    with pytest.raises(
        CheckpointError, match=r"written by 2 ranks but this run has 1.*resume it with 2 ranks"
    ):
        fit(tmp_path / "r3", max_steps=3, ckpt_path=other)
    trainer, _ = fit(tmp_path / "r4", max_steps=3, ckpt_path=str(good))  # the intact one still resumes
    assert trainer.global_step == 3


def test_importing_the_strategies_registers_them_with_lightning():
    from lightning.pytorch.strategies import StrategyRegistry

    from torchrec_lookahead.strategies import HierarchicalStrategy, TorchRecStrategy

    assert StrategyRegistry["torchrec"]["strategy"] is TorchRecStrategy
    assert StrategyRegistry["hierarchical"]["strategy"] is HierarchicalStrategy
    assert "TorchRec" in StrategyRegistry["torchrec"]["description"]


def test_batch_to_device_applies_each_training_batchs_plans_once_through_the_session(tmp_path, monkeypatch):
    from torchrec_lookahead.runtime import CacheSession

    applied = []
    apply = CacheSession.apply

    def recording(self, batch):
        applied.append(batch.plan.step)
        apply(self, batch)

    monkeypatch.setattr(CacheSession, "apply", recording)
    fit_cached(tmp_path, 3)
    assert applied == [0, 1, 2]  # every step's plan, in order, once, before its training step


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"compute_kernel": "bogus"}, r"compute_kernel must be one of 'dense', 'fused'.* but got 'bogus'"),
        ({"sharding_types": ["bogus"]}, r"sharding_types must be one of 'data_parallel'.* but got 'bogus'"),
        ({"sharding_types": "table_wise"}, r"sharding_types must be a list but got 'table_wise'"),
        ({"sharders": object()}, r"sharders must be a list of sharders but got object"),
    ],
)
def test_bad_kernel_sharding_types_and_sharders_are_refused_listing_the_valid_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TorchRecStrategy(**kwargs)
    assert (
        TorchRecStrategy(compute_kernel="dense", sharding_types=["data_parallel"])._compute_kernel == "dense"
    )


def test_an_error_in_validation_stops_the_lookahead_threads(tmp_path, monkeypatch):
    """A bad validation batch raised out of fit while the training loader's planner, reader and stager threads ran
    on (Lightning calls no DataModule teardown after an error); the interpreter then aborted at exit."""
    import threading

    from torchrec_lookahead import DataError
    from torchrec_lookahead.data import CriteoSyntheticDataModule

    clean = CriteoSyntheticDataModule.val_dataloader

    def bad_val(self):
        for i, batch in enumerate(clean(self)):
            if i == 1:
                raise DataError("val.tsv:1001: a bad line")
            yield batch

    monkeypatch.setattr(CriteoSyntheticDataModule, "val_dataloader", bad_val)
    with pytest.raises(DataError, match="a bad line"):
        fit_cached(tmp_path, 8, val_check_interval=3, limit_val_batches=2, num_sanity_val_steps=0)
    running = [t.name for t in threading.enumerate() if t.name.startswith("lookahead")]
    assert running == [], running


def test_a_sharder_seed_unlike_the_strategys_init_seed_is_refused(tmp_path):
    """The sharder's ``seed`` set the cached tables' initial values while ``init_seed`` set the resident ones': a
    sharder given ``seed=1`` beside the default ``init_seed=0`` trained 0.52 away from resident training, silently."""
    with pytest.raises(ConfigError, match="the sharder's seed=1 differs from the strategy's init_seed=0"):
        fit_cached(tmp_path / "a", 1, sharder_kw={"seed": 1})
    trainer, _ = fit_cached(tmp_path / "b", 1, sharder_kw={"seed": 3}, strategy_kw={"init_seed": 3})
    assert trainer.global_step == 1
    trainer, _ = fit_cached(tmp_path / "c", 1, sharder_kw={"seed": 3}, strategy_kw={"init_seed": None})
    assert trainer.global_step == 1  # TorchRec's random resident values: nothing to match
    # a sharder without a seed of its own takes each strategy's: reused with another init_seed, it trains
    from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
    from torchrec_lookahead.strategies._sharding import seed_sharders

    reused = LookaheadEmbeddingBagCollectionSharder(capacity={"t_cat_2": 140})
    seed_sharders([reused], 1)
    seed_sharders([reused], 2)
    assert reused.seed == 2


def test_a_model_overriding_a_batch_hook_is_refused_for_cached_training(tmp_path):
    """``on_after_batch_transfer`` saw cache slots where it expected ids (a hook re-hashing them trained 0.36 from
    resident); one returning a new batch failed with a message blaming a missing LookaheadDataModule."""
    from torchrec_lookahead.models import DLRMModule

    class Hooked(DLRMModule):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            return batch

    with pytest.raises(
        ConfigError, match=r"Hooked overrides \['on_after_batch_transfer'\]: with cached tables"
    ):
        fit_cached(tmp_path / "cached", 1, model_cls=Hooked)
    trainer, _ = fit_cached(
        tmp_path / "resident", 1, capacity={}, model_cls=Hooked
    )  # nothing cached: the user's
    assert trainer.global_step == 1


def test_a_second_forward_of_the_cached_tables_in_a_step_is_named_as_such(tmp_path):
    """Two passes of the batch in one training step (R-Drop, or a no_grad pass first) were refused with a message
    saying to wrap the DataModule in LookaheadDataModule, which the user had done."""
    from torchrec_lookahead.models import DLRMModule

    class TwoPasses(DLRMModule):
        def training_step(self, batch, batch_idx):
            super().training_step(batch, batch_idx)
            return super().training_step(batch, batch_idx)

    with pytest.raises(SetupError, match="A second training forward of the cached tables after the one that used "
                                         "step 0's plan: a step's plan covers one forward"):  # fmt: skip
        fit_cached(tmp_path, 1, model_cls=TwoPasses)


def test_a_model_overriding_a_batch_hook_keeps_it_under_a_pass_through_lookahead_datamodule(tmp_path):
    """With no cached tables the LookaheadDataModule passes batches through: the LightningModule's own hooks run
    (the wrapper defined every hook, and Lightning runs a DataModule's instead of the LightningModule's)."""
    from torchrec_lookahead.data import CriteoSyntheticDataModule, LookaheadDataModule
    from torchrec_lookahead.models import DLRMModule

    from ..conftest import tiny_data_args
    from ..helpers import _trainer, make_model

    calls = []

    class Hooked(DLRMModule):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            calls.append(1)
            return batch

    inner = CriteoSyntheticDataModule(**tiny_data_args())
    trainer = _trainer(tmp_path, 3, None, strategy=TorchRecStrategy())
    trainer.fit(make_model(inner, model_cls=Hooked), datamodule=LookaheadDataModule(inner))
    assert len(calls) >= 3
    with pytest.raises(TypeError, match="instance"):  # Lightning's guard: it returns a new model
        make_model(inner).load_from_checkpoint("model.ckpt")


@pytest.mark.parametrize("capacity", [None, {}], ids=["cached", "resident"])
def test_weight_averaging_callbacks_are_refused_before_the_fit_sets_anything_up(tmp_path, capacity):
    """EMAWeightAveraging (Lightning's WeightAveraging) copies the LightningModule at set-up, before the strategy
    has built and sharded the tables: the fit stopped with torch's 'Cannot copy out of meta tensor' traceback."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    with pytest.raises(
        ConfigError, match="^EMAWeightAveraging cannot average a model trained with TorchRecStrategy"
    ):
        fit_cached(tmp_path, max_steps=2, capacity=capacity, callbacks=[EMAWeightAveraging()])
    assert not list(tmp_path.rglob("*.ckpt"))


def test_model_pruning_that_would_find_no_layers_is_refused_before_the_fit_sets_anything_up(tmp_path):
    """ModelPruning looks for layers at set-up, before configure_model builds those of the bundled modules: the
    fit trained its first epoch and then stopped with 'torch.cat(): expected a non-empty list of Tensors'."""
    from lightning.pytorch.callbacks import ModelPruning

    pruning = ModelPruning("l1_unstructured", amount=0.2)
    with pytest.raises(
        ConfigError, match="^ModelPruning finds no weight or bias parameters to prune in DLRMModule"
    ):
        fit_cached(tmp_path, max_steps=-1, callbacks=[pruning], max_epochs=1)
    assert not list(tmp_path.rglob("*.ckpt"))
