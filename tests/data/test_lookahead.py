"""Cached training under Lightning equals resident training (contract 1), and the cache's other contracts."""

import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from torchrec_lookahead import CapacityError, ConfigError, InvalidIdError, SetupError
from torchrec_lookahead.data import LookaheadDataModule
from torchrec_lookahead.oracle import LookaheadSettings
from torchrec_lookahead.runtime import CacheSession, CacheTarget, LookaheadLoader
from torchrec_lookahead.store import TensorStore

from ..conftest import TINY_TABLES
from ..helpers import fit_cached, max_abs_diff, weights

_RESIDENT: dict = {}


def _resident(tmp_path, steps, **kw):
    """The resident weights after ``steps``, trained once per session for each setting (resident training is
    deterministic: the tests compare with it bit for bit)."""
    key = repr((steps, sorted(kw.items())))
    if key not in _RESIDENT:
        _RESIDENT[key] = weights(fit_cached(tmp_path / "resident", steps, capacity={}, **kw)[1])
    return _RESIDENT[key]


@pytest.mark.parametrize(
    "policy, emb, data",
    [
        ("belady", "rowwise_adagrad", None),
        pytest.param("lru", "sgd", None, marks=pytest.mark.slow),
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
    with pytest.raises(CapacityError, match=r"t_cat_2.*needs? \d+ cache rows but capacity"):
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
    return LookaheadLoader(batches, CacheSession(target), LookaheadSettings(horizon=4))


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
        staged = loader.staged_rows(b.plan, b.staged)
        out.append(
            (b.plan.tables["t"].fetch_ids.tolist(), staged.tables["t"].ids.tolist() if staged.tables else [])
        )
        loader.progress.applied(b.plan.step)
    assert [f for f, _ in out] == [s for _, s in out]
    assert sorted(sum((f for f, _ in out), [])) == [1, 2, 3, 4]
    bad = _loader([batch([1, 12])], {"t": 4}, {"t": store}, 10)
    with pytest.raises(InvalidIdError, match="12"):
        list(bad)


def test_a_loader_state_of_another_pipeline_is_a_checkpoint_error_that_says_whose():
    from torchrec_lookahead import CheckpointError

    loader = _loader([], {"t": 4}, {"t": TensorStore(10, 4, name="t")}, 10)
    with pytest.raises(
        CheckpointError, match="written by a run with FAE's HotColdDataModule; resume it with"
    ):
        loader.load_state_dict({"hot_served": 3, "cold_served": 5})
    with pytest.raises(
        CheckpointError, match="not a lookahead loader's .*; resume it with the config that wrote"
    ):
        loader.load_state_dict({"epoch": 1})
    loader.load_state_dict({"batches_yielded": 2})


def test_a_peers_death_at_the_threads_shutdown_is_not_logged_again_as_an_error(caplog):
    """The training thread's own error reports a dead peer; the background threads' shutdown error saying the same
    is kept for close() but logged at debug level; any other shutdown error is logged as an error."""
    import logging

    class _Run:
        def __init__(self, err):
            self.err = err

        def stop(self):
            return self.err

    loader = _loader([], {"t": 4}, {"t": TensorStore(10, 4, name="t")}, 10)
    with caplog.at_level(logging.DEBUG, logger="torchrec_lookahead.runtime.loader"):
        loader._stopped(_Run(RuntimeError("[pair.cc:534] Connection reset by peer [127.0.0.1]:5431")))
        loader._stopped(_Run(SetupError("the stager did not stop")))
    levels = [(r.levelno, r.getMessage().split(" [")[0]) for r in caplog.records]
    assert levels == [
        (logging.DEBUG, "[pair.cc:534] Connection reset by peer"),
        (logging.ERROR, "the stager did not stop"),
    ]


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


def test_the_reader_thread_reads_ahead_and_hands_a_loading_error_to_training_in_order():
    """The wrapped loader is read on a thread of its own, ahead of the planner; an error while reading reaches
    the training thread after the batches read before it, and every lookahead thread ends."""
    import threading

    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    readers = set()

    class Broken:
        def __iter__(self):
            for i in range(8):
                readers.add(threading.current_thread().name if i else "first")
                kjt = KeyedJaggedTensor(
                    keys=["f"], values=torch.tensor([i]), lengths=torch.ones(1, dtype=torch.int32)
                )
                yield Batch(torch.zeros(1, 1), kjt, torch.zeros(1))
            raise OSError("disk gone at batch 8")

        def __len__(self):
            return 9

    loader = _loader(Broken(), {"t": 4}, {"t": TensorStore(10, 4, name="t")}, 10)
    got = []
    with pytest.raises(OSError, match="disk gone at batch 8"):
        for b in loader:
            got.append(b.plan.step)
            loader.progress.applied(b.plan.step)
    # the batches planned before the error (horizon 4: those the oracle could plan), then the error
    assert got and got == list(range(len(got))) and readers == {"first", "lookahead-reader"}
    assert loader.stats().read == 8
    assert not [t.name for t in threading.enumerate() if t.name.startswith("lookahead-")]


def test_stopping_mid_epoch_stops_the_background_threads(tmp_path, caplog):
    import logging
    import threading

    with caplog.at_level(logging.WARNING, logger="torchrec_lookahead"):
        trainer, _ = fit_cached(tmp_path, 4)  # 12 batches per epoch: stops with the loader mid-stream
    assert trainer.global_step == 4 and trainer.num_training_batches == 12
    # the threads ended when the loader closed, not abandoned at the end of its join timeout
    assert not [r.getMessage() for r in caplog.records if "did not stop within" in r.getMessage()]
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


def _late_window_capacity(table: str, batches: int, early: int):
    """A capacity for ``table`` that holds every window of the first ``early`` batches but not a later one."""
    import numpy as np

    from torchrec_lookahead.data import CriteoSyntheticDataModule

    from ..conftest import tiny_data_args

    dm = CriteoSyntheticDataModule(**tiny_data_args(num_train_batches=batches))
    dm.setup("fit")
    feature = table[len("t_") :]
    ids = [np.unique(b.sparse_features[feature].values().numpy()) for b in dm.train_dataloader()]
    need = [len(ids[0])] + [len(np.union1d(a, b)) for a, b in zip(ids, ids[1:])]
    cap = max(need[:early])
    assert max(need) > cap, need  # the data has such a late window
    return cap


@pytest.mark.parametrize("check, fails_before_training", [("epoch", True), ("lookahead", False)])
def test_a_late_window_that_does_not_fit(tmp_path, check, fails_before_training):
    table, batches = "t_cat_11", 40
    cap = _late_window_capacity(table, batches, early=14)
    steps = []

    class Count(pl.Callback):
        def on_train_batch_start(self, *args):
            steps.append(1)

    with pytest.raises(
        CapacityError, match=rf"{table}.*needs? \d+ cache rows but capacity\['{table}'\] is {cap}"
    ):
        fit_cached(
            tmp_path,
            batches,
            capacity={table: cap},
            data={"num_train_batches": batches},
            callbacks=[Count()],
            lookahead_kw={"capacity_check": check},
        )
    assert (len(steps) == 0) == fails_before_training, len(steps)


def test_check_stream_matches_the_oracle_minimum_and_refuses_bad_ids():
    from torchrec_lookahead.oracle import OracleConfig, min_capacity
    from torchrec_lookahead.runtime.capacity import check_stream

    gen = torch.Generator().manual_seed(3)
    stream = [{"a": torch.randint(0, 50, (20,), generator=gen), "b": torch.randint(0, 9, (7,), generator=gen)}
              for _ in range(30)]  # fmt: skip
    f2t = {"a": "ta", "b": "tb"}
    for depth in (0, 1, 3):
        want = min_capacity(stream, depth, OracleConfig(capacity={"ta": 1, "tb": 1}, feature_to_table=f2t))
        got = check_stream(stream, want, f2t, {"ta": 50, "tb": 9}, depth)
        assert got == want
        short = {"ta": want["ta"] - 1, "tb": want["tb"]}
        with pytest.raises(CapacityError, match=rf"'ta'.*largest windows need \{{'ta': {want['ta']}\}}"):
            check_stream(stream, short, f2t, {"ta": 50, "tb": 9}, depth)
    bad = stream[:5] + [{"a": torch.tensor([3, 50]), "b": torch.tensor([1])}]
    with pytest.raises(InvalidIdError, match="'ta': batch 5 holds id 50"):
        check_stream(bad, {"ta": 100, "tb": 100}, f2t, {"ta": 50, "tb": 9}, 1)
    with pytest.raises(InvalidIdError, match="id -1"):
        check_stream(
            [{"a": torch.tensor([-1]), "b": torch.tensor([1])}],
            {"ta": 9, "tb": 9},
            f2t,
            {"ta": 50, "tb": 9},
            1,
        )


def test_preserved_rng_keeps_a_shuffling_loaders_order():
    from torch.utils.data import DataLoader

    from torchrec_lookahead._rng import preserved_rng

    loader = DataLoader(list(range(20)), batch_size=4, shuffle=True)
    torch.manual_seed(0)
    with preserved_rng():
        scanned = [b.tolist() for b in loader]
    after = [b.tolist() for b in loader]
    torch.manual_seed(0)
    assert after == [b.tolist() for b in loader] == scanned


def test_capacity_check_value_is_validated():
    from torchrec_lookahead.data import CriteoSyntheticDataModule
    from torchrec_lookahead.oracle import Policy
    from torchrec_lookahead.runtime import CapacityCheck

    with pytest.raises(ConfigError, match="capacity_check 'epoch' or 'lookahead' but got 'never'"):
        LookaheadDataModule(CriteoSyntheticDataModule(num_embeddings=TINY_TABLES), capacity_check="never")
    dm = LookaheadDataModule(
        CriteoSyntheticDataModule(num_embeddings=TINY_TABLES), capacity_check=CapacityCheck.LOOKAHEAD
    )
    assert dm.capacity_check is CapacityCheck.LOOKAHEAD
    # the YAML strings convert to the enums; a bad policy is a typed error naming the values
    dm = LookaheadDataModule(
        CriteoSyntheticDataModule(num_embeddings=TINY_TABLES), policy="ttl", capacity_check="epoch"
    )
    assert dm.policy is Policy.TTL and dm.capacity_check is CapacityCheck.EPOCH
    with pytest.raises(
        ConfigError, match=r"policy must be one of 'belady', 'ttl', 'window', 'lru' but got 'fifo'"
    ):
        LookaheadDataModule(CriteoSyntheticDataModule(num_embeddings=TINY_TABLES), policy="fifo")


def test_lookahead_threads_run_their_operators_single_threaded_without_changing_others():
    import threading

    from torchrec_lookahead.runtime._threads import single_threaded_ops

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        seen = {}

        def planner():
            single_threaded_ops()
            seen["planner"] = torch.get_num_threads()

        def later():
            seen["later"] = torch.get_num_threads()

        for fn in (planner, later):
            t = threading.Thread(target=fn)
            t.start()
            t.join()
        assert seen == {"planner": 1, "later": 2}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_preserved_rng_keeps_the_order_of_a_loader_with_its_own_generator():
    from torch.utils.data import DataLoader

    from torchrec_lookahead._rng import preserved_rng

    def order(seed_first_pass: bool):
        loader = DataLoader(
            list(range(20)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0)
        )
        if seed_first_pass:
            with preserved_rng(loader):
                [b.tolist() for b in loader]
        return [b.tolist() for b in loader]

    assert order(True) == order(False)


def test_variable_batch_kjts_are_refused_by_the_cache():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_lookahead import DataError
    from torchrec_lookahead.modules import remap_kjt
    from torchrec_lookahead.oracle.types import BatchPlan

    vbe = KeyedJaggedTensor(keys=["f", "g"], values=torch.arange(5), lengths=torch.ones(5, dtype=torch.int32),
                            stride_per_key_per_rank=[[2], [3]])  # fmt: skip
    with pytest.raises(DataError, match="variable-batch"):
        remap_kjt(vbe, BatchPlan(0, {}), {"f": "t"}, ["t"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux-only")
def test_the_planner_thread_runs_at_lower_priority_than_training():
    import os
    import threading

    from torchrec_lookahead.runtime._threads import lower_thread_priority

    seen = {}

    def planner():
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        lower_thread_priority(5)
        seen["delta"] = os.getpriority(os.PRIO_PROCESS, tid) - before

    t = threading.Thread(target=planner)
    t.start()
    t.join()
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen["delta"] == min(5, 19 - main)
    assert os.getpriority(os.PRIO_PROCESS, 0) == main  # the process (main thread) keeps its priority


def test_planner_nice_is_validated():
    from torchrec_lookahead.data import CriteoSyntheticDataModule

    with pytest.raises(ConfigError, match="planner_nice"):
        LookaheadDataModule(CriteoSyntheticDataModule(num_embeddings=TINY_TABLES), planner_nice=20)


def test_cdlrm_mode_needs_evictions_only_at_averaging_steps():
    from torchrec_lookahead.data.lookahead import check_cdlrm_schedule

    check_cdlrm_schedule("belady", 8, None)  # exact LRPP: anything goes
    check_cdlrm_schedule("belady", 8, 1)  # averaged every step
    check_cdlrm_schedule("window", 8, 8)
    check_cdlrm_schedule("window", 16, 4)
    for policy, window, lam in (("belady", 8, 8), ("window", 8, 16), ("window", 6, 4)):
        with pytest.raises(ConfigError, match="cdlrm_average_every"):
            check_cdlrm_schedule(policy, window, lam)


def test_training_thread_gathers_rows_the_stager_has_not_started_and_stays_exact(tmp_path, monkeypatch):
    """A stager that never runs (a starved thread, taken to the limit): every step's rows are gathered by the
    training thread instead of waited for, and training equals resident training."""

    def idle_stager(self, run):  # leaves every staged future pending
        while not run.stopped:
            run._stop.wait(0.05)

    monkeypatch.setattr(LookaheadLoader, "_stage", idle_stager)
    trainer, cached = fit_cached(tmp_path / "cached", 20)
    assert trainer.datamodule.loader.stats().gathered_here == 20
    assert max_abs_diff(weights(cached), _resident(tmp_path, 20)) <= 1e-5


def test_a_cached_mid_epoch_resume_over_an_edited_training_file_is_refused(tmp_path):
    """The lookahead loader records what its wrapped loader records (the files of its epoch), so a resume over an
    edited file is refused as the resident loader refuses it, and over the same file it trains on."""
    import random

    from torchrec_lookahead import CheckpointError
    from torchrec_lookahead.data import CriteoTSVDataModule
    from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
    from torchrec_lookahead.strategies import TorchRecStrategy

    from ..helpers import _trainer, make_model

    rng = random.Random(0)
    train = tmp_path / "train.tsv"

    def lines(n: int) -> str:
        hexes = lambda: [f"{rng.getrandbits(32):08x}" for _ in range(26)]  # noqa: E731
        return "".join("\t".join(["1"] + ["3"] * 13 + hexes()) + "\n" for _ in range(n))

    train.write_text(lines(96))

    def fit(root, steps, ckpt_path=None, callbacks=None):
        inner = CriteoTSVDataModule(train_files=str(train), batch_size=8, num_embeddings=100)
        dm = LookaheadDataModule(inner, horizon=4, prefetch_depth=1)
        sharder = LookaheadEmbeddingBagCollectionSharder(capacity={"t_cat_0": 40, "t_cat_1": 40})
        trainer = _trainer(root, steps, callbacks, strategy=TorchRecStrategy(sharders=[sharder]))
        pl.seed_everything(0, verbose=False)
        trainer.fit(make_model(inner), datamodule=dm, ckpt_path=ckpt_path)
        return trainer

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    fit(tmp_path / "a", 6, callbacks=[ckpt])
    path = str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    assert fit(tmp_path / "b", 6, ckpt_path=path).global_step == 6  # the same file: resumes
    train.write_text(lines(88))
    with pytest.raises(CheckpointError, match="stopped after batch 3 of an epoch over the files"):
        fit(tmp_path / "c", 6, ckpt_path=path)
