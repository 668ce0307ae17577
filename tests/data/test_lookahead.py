"""Cached training under Lightning equals resident training (contract 1), and the cache's other contracts."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from torchrec_lookahead import CapacityError, ConfigError, InvalidIdError, SetupError
from torchrec_lookahead.data import LookaheadDataModule, LookaheadLoader
from torchrec_lookahead.data.lookahead import CacheTarget
from torchrec_lookahead.store import TensorStore

from ..conftest import TINY_TABLES
from ..helpers import fit_cached, max_abs_diff, weights


def _resident(tmp_path, steps, **kw):
    return weights(fit_cached(tmp_path / "resident", steps, capacity={}, **kw)[1])


@pytest.mark.parametrize(
    "policy, emb, data",
    [
        ("belady", "rowwise_adagrad", None),
        ("lru", "sgd", None),
        ("ttl", "rowwise_adagrad", None),
        ("belady", "sgd", {"multi_hot": 3}),
    ],
)
def test_cached_fit_equals_resident(tmp_path, policy, emb, data):
    _, cached = fit_cached(tmp_path / "cached", 30, policy=policy, emb=emb, data=data)
    resident = _resident(tmp_path, 30, emb=emb, data=data)
    assert max_abs_diff(weights(cached), resident) <= 1e-5


@pytest.mark.slow
def test_cached_fit_equals_resident_over_many_epochs_at_minimum_capacity(tmp_path):
    # 120 steps = 10 epochs of 12 batches: every epoch flushes, empties the cache and restarts the oracle.
    capacity = {"t_cat_2": 95, "t_cat_11": 80, "t_cat_20": 60}
    _, cached = fit_cached(tmp_path / "cached", 120, capacity=capacity)
    resident = _resident(tmp_path, 120)
    assert max_abs_diff(weights(cached), resident) <= 1e-5


def test_validation_during_training_keeps_results_exact(tmp_path):
    kw = dict(limit_val_batches=2, val_check_interval=4)
    _, cached = fit_cached(tmp_path / "cached", 10, **kw)
    resident = weights(fit_cached(tmp_path / "resident", 10, capacity={}, **kw)[1])
    assert max_abs_diff(weights(cached), resident) <= 1e-5


def test_mid_epoch_checkpoint_of_a_cached_model_resumes_the_same_weights(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    _, full = fit_cached(tmp_path / "full", 10, callbacks=[ckpt])
    _, resumed = fit_cached(tmp_path / "r", 10, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=5.ckpt"))
    assert max_abs_diff(weights(full), weights(resumed)) <= 1e-6


def test_capacity_below_the_window_working_set_fails_before_training(tmp_path):
    with pytest.raises(CapacityError, match=r"t_cat_2.*need \d+ cache rows but capacity"):
        fit_cached(tmp_path, 5, capacity={"t_cat_2": 20})


def test_training_without_the_lookahead_datamodule_is_refused(tmp_path):
    with pytest.raises(SetupError, match="LookaheadDataModule"):
        fit_cached(tmp_path, 2, wrap=False)


def test_unknown_table_in_capacity_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="Unknown table"):
        fit_cached(tmp_path, 2, capacity={"t_colour": 10})


class _Boom(pl.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 4:
            raise RuntimeError("boom")


def test_an_exception_flushes_every_cached_row_to_the_store(tmp_path):
    holder = {}

    class Keep(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            holder["modules"] = trainer.strategy.cached_modules()

    with pytest.raises(RuntimeError, match="boom"):
        fit_cached(tmp_path, 10, callbacks=[Keep(), _Boom()])
    (module,) = holder["modules"]
    cache = module.cache
    for table in cache.capacity:
        slots = cache.slot_ids(table)
        held = (slots >= 0).nonzero().flatten()
        assert held.numel() > 0
        stored, _ = cache.stores[table].gather(slots[held])
        assert torch.equal(stored, cache.cache_weights(table)[held])


def _loader(batches, capacity, stores, rows):
    target = CacheTarget(
        capacity=capacity, feature_to_table={"f": "t"}, num_embeddings={"t": rows}, stores=stores
    )
    return LookaheadLoader(batches, target, horizon=4, prefetch_depth=1, policy="belady")


def test_loader_stages_rows_and_refuses_out_of_range_ids():
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def batch(ids):
        kjt = KeyedJaggedTensor(
            keys=["f"], values=torch.tensor(ids), lengths=torch.ones(len(ids), dtype=torch.int32)
        )
        return Batch(torch.zeros(len(ids), 1), kjt, torch.zeros(len(ids)))

    store = TensorStore(10, 4, name="t")
    loader = _loader([batch([1, 2]), batch([2, 3]), batch([4, 1])], {"t": 4}, {"t": store}, 10)
    out = []
    for b in loader:
        staged = b.wait_staged()
        out.append(
            (b.plan.tables["t"].fetch_ids.tolist(), staged.tables["t"].ids.tolist() if staged.tables else [])
        )
        b.mark_applied()
    assert [f for f, _ in out] == [s for _, s in out]
    assert sorted(sum((f for f, _ in out), [])) == [1, 2, 3, 4]
    bad = _loader([batch([1, 12])], {"t": 4}, {"t": store}, 10)
    with pytest.raises(InvalidIdError, match="12"):
        list(bad)


def test_lookahead_datamodule_validates_its_arguments():
    from torchrec_lookahead.data import CriteoSyntheticDataModule

    inner = CriteoSyntheticDataModule(num_embeddings=TINY_TABLES)
    with pytest.raises(ConfigError, match="prefetch_depth"):
        LookaheadDataModule(inner, horizon=2, prefetch_depth=3)
    with pytest.raises(ConfigError, match="policy"):
        LookaheadDataModule(inner, policy="fifo")
    assert LookaheadDataModule(inner).num_embeddings_per_feature == inner.num_embeddings_per_feature


def test_a_model_left_in_eval_mode_during_fit_is_refused(tmp_path):
    class EvalOnStart(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            pl_module.eval()

    with pytest.raises(SetupError, match="eval mode"):
        fit_cached(tmp_path, 3, callbacks=[EvalOnStart()])


def test_stopping_mid_epoch_stops_the_background_threads(tmp_path):
    import threading
    import time

    t0 = time.perf_counter()
    fit_cached(tmp_path, 4)  # 12 batches per epoch: stops with the loader mid-stream
    assert time.perf_counter() - t0 < 30
    alive = [t.name for t in threading.enumerate() if t.name.startswith("lookahead-")]
    assert not alive, alive


def test_sigterm_flushes_every_cached_row_to_the_store(tmp_path):
    import os
    import signal

    holder = {}

    class TermAtStep4(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            holder["modules"] = trainer.strategy.cached_modules()

        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 4:
                os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(BaseException) as raised:  # Lightning turns SIGTERM into an exception in the loop
        fit_cached(tmp_path, 10, callbacks=[TermAtStep4()])
    assert "SIGTERM" in type(raised.value).__name__ or "SIGTERM" in str(raised.value)
    (module,) = holder["modules"]
    cache = module.cache
    for table in cache.capacity:
        slots = cache.slot_ids(table)
        held = (slots >= 0).nonzero().flatten()
        stored, _ = cache.stores[table].gather(slots[held])
        assert torch.equal(stored, cache.cache_weights(table)[held])
