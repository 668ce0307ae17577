"""``LookaheadTrainPipeline``: a plain TorchRec loop through the cache equals TorchRec's resident loop bit for
bit (one rank in-process, two under torchrun), streams its data, and refuses what it cannot train."""

import json
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from torchrec_lookahead import CapacityError, ConfigError, DataError, LookaheadTrainPipeline, SetupError

from .cli.test_cli import clean_env
from .conftest import REPO, free_port
from .pipeline_runs import build, compare, train


@pytest.fixture(scope="module")
def pg():
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


@pytest.mark.slow
def test_one_rank_cached_pipeline_equals_torchrec_resident_pipeline_over_two_epochs(pg):
    resident = train(cached=False, epochs=2)
    cached = train(cached=True, epochs=2)
    result = compare(cached, resident)
    assert result["steps"] == 24 and result["losses_equal"], (cached["losses"], resident["losses"])
    assert sorted(resident["weights"]) == result["keys"]  # every table and dense layer compared
    assert any(".embedding_bags.t_cat_2." in k for k in result["keys"])  # a cached table among them
    assert result["max_dw"] == 0.0


@pytest.mark.slow
def test_the_stream_is_read_as_training_goes_not_ahead_of_it(pg):
    steps = 40
    run = train(cached=True, steps=steps, batch_size=16, horizon=4, queue_depth=2)
    assert len(run["losses"]) == steps
    # Read ahead of training, at most: the batch TorchRec's pipeline holds for its next step (1), the planned
    # batches waiting for it (queue_depth, raised by the loader to at least prefetch_depth + 2), the oracle's
    # window and the batch the planner hands out (horizon + 1), the batches the reader thread read for the planner
    # (queue_depth) and the one it holds (1): a bound (reached when training is the slowest thread), not the stream.
    depth = run["queue_depth"]
    assert depth == 3, depth
    lead = 1 + depth + 4 + 1 + depth + 1
    assert all(r - i <= lead for i, r in enumerate(run["read"], 1)), run["read"]


def test_a_window_that_does_not_fit_is_a_typed_error_before_the_first_step_and_stops_the_threads(pg):
    _, pipeline, data = build(cached=True, capacity={"t_cat_2": 4}, horizon=4)
    with pytest.raises(CapacityError, match="t_cat_2"):
        pipeline.progress(iter(data))
    assert pipeline.loader is not None and pipeline.loader._run is None


def test_eval_mode_is_refused_and_a_model_without_cached_tables_trains_as_under_torchrec(pg):
    dmp, pipeline, data = build(cached=True, steps=2)
    dmp.eval()
    with pytest.raises(SetupError, match=r"model.train\(\)"):
        pipeline.progress(iter(data))
    dmp, pipeline, data = build(cached=True, steps=2, capacity={})
    assert pipeline.loader is None and not pipeline.cached
    it = iter(data)
    assert pipeline.progress(it)[0].ndim == 0 and pipeline.progress(it)[0].ndim == 0
    with pytest.raises(StopIteration):
        pipeline.progress(it)


def _steps_to_the_end(pipeline: LookaheadTrainPipeline, it) -> int:
    """The steps ``pipeline`` trains from ``it`` until its stream ends."""
    steps = 0
    with pytest.raises(StopIteration):
        while True:
            pipeline.progress(it)
            steps += 1
    return steps


def test_an_iterator_whose_stream_was_closed_mid_way_is_refused_and_a_new_one_starts_a_stream(pg):
    _, pipeline, data = build(cached=True, steps=6)
    it = iter(data)
    pipeline.progress(it)
    pipeline.progress(it)
    pipeline.close()  # the planner had read batches of `it` ahead of training: they went with the stream
    with pytest.raises(SetupError, match=r"closed mid-way.*pass a new iterator"):
        pipeline.progress(it)
    assert _steps_to_the_end(pipeline, iter(data)) == 6  # the whole stream, from the start
    pipeline.close()


def test_another_iterator_in_the_middle_of_a_stream_is_refused_and_trains_after_a_reset(pg):
    """``progress(iter(other))`` mid-stream kept training the first stream (its planned batches), never the new
    data, without a word."""
    _, pipeline, data = build(cached=True, steps=6)
    it = iter(data)
    pipeline.progress(it)
    with pytest.raises(SetupError, match=r"another iterator while a stream is in progress.*call reset\(\)"):
        pipeline.progress(iter(data))
    pipeline.progress(it)  # the stream in progress goes on
    pipeline.reset()
    assert _steps_to_the_end(pipeline, iter(data)) == 6


def test_bad_settings_are_refused_before_anything_runs():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="prefetch_depth=5"):
        LookaheadTrainPipeline(model, opt, torch.device("cpu"), horizon=4, prefetch_depth=5)
    with pytest.raises(ConfigError, match=r"policy must be one of 'belady'.* but got 'fifo'"):
        LookaheadTrainPipeline(model, opt, torch.device("cpu"), policy="fifo")
    # the loader's options, as LookaheadDataModule checks them (queue_depth was not checked; the others only
    # with cached tables)
    for kw, match in (
        ({"queue_depth": 0}, "queue_depth must be an integer >= 1"),
        ({"stop_timeout_s": 0}, "stop_timeout_s > 0"),
        ({"stop_timeout_s": "1"}, "stop_timeout_s > 0"),
        # inf passed, then the threads' join at the stream's end raised an OverflowError traceback
        ({"stop_timeout_s": float("inf")}, r"stop_timeout_s > 0 \(seconds, finite\) but got inf"),
        ({"planner_nice": 25}, "planner_nice in \\[0, 19\\]"),
    ):
        with pytest.raises(ConfigError, match=match):
            LookaheadTrainPipeline(model, opt, torch.device("cpu"), **kw)  # type: ignore[arg-type]


def test_a_model_optimizer_or_device_of_the_wrong_type_is_a_config_error_and_a_device_name_is_taken():
    """A model or device of the wrong type failed with an AttributeError traceback (at construction, or at the
    first step for the optimizer); ``"cpu"`` (TorchRec's pipeline takes only a torch.device) as well."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cpu = torch.device("cpu")
    for args, match in (
        ((None, opt, cpu), "model must be a torch.nn.Module .* but got NoneType"),
        ((model, None, cpu), "optimizer must be an optimizer .* but got NoneType"),
        ((model, opt, 0.5), "device must be a torch.device .* but got float"),
        ((model, opt, "gpu"), "device must be a device but got 'gpu'"),
    ):
        with pytest.raises(ConfigError, match=match):
            LookaheadTrainPipeline(*args)  # type: ignore[arg-type]
    assert LookaheadTrainPipeline(model, opt, "cpu")._device == cpu  # type: ignore[arg-type]


def test_eval_mode_mid_stream_is_refused_before_the_step_and_the_stream_goes_on_after_train(pg):
    """``model.eval()`` between steps and ``progress``: the cached modules refused the planned batch in the middle
    of the forward, and the stream (read ahead of training) was closed with it: training could not go on."""
    dmp, pipeline, data = build(cached=True, steps=6)
    it, losses = iter(data), []
    losses += [float(pipeline.progress(it)[0]) for _ in range(2)]
    dmp.eval()
    with pytest.raises(SetupError, match=r"in eval mode: call model.train\(\) before progress\(\)"):
        pipeline.progress(it)
    dmp.train()
    with pytest.raises(StopIteration):
        while True:
            losses.append(float(pipeline.progress(it)[0]))
    pipeline.close()
    assert losses == train(cached=False, steps=6)["losses"]


def test_dict_batches_are_refused_with_what_the_pipeline_takes(pg):
    """The refusal pointed a plain-loop user to LookaheadDataModule(batch_adapter=...), which the pipeline has
    not."""
    _, pipeline, data = build(cached=True, steps=3)
    dicts = ({"dense": b.dense_features, "sparse": b.sparse_features, "labels": b.labels} for b in data)
    with pytest.raises(
        DataError, match=r"^LookaheadTrainPipeline's iterator yields dict batches with keys"
    ) as e:
        pipeline.progress(dicts)
    assert "convert them in the iterator" in str(e.value)
    assert not [t for t in threading.enumerate() if t.name.startswith("lookahead")]


def test_a_second_pipeline_on_the_model_closes_the_stream_the_first_left_in_progress(pg):
    """A loop without ``with`` that raised left its pipeline's stream in progress; a second pipeline's stream on
    the same model emptied the caches the first's plans relied on: both trained on, wrong (losses and weights
    different from TorchRec's, silently), and the first's threads ran on."""
    dmp, first, data = build(cached=True, steps=6)
    it = iter(data)
    losses = [float(first.progress(it)[0]) for _ in range(2)]
    second = LookaheadTrainPipeline(dmp, first._optimizer, torch.device("cpu"))
    it2 = iter(data)
    with pytest.raises(StopIteration):
        while True:
            losses.append(float(second.progress(it2)[0]))
    assert first.loader is not None and first.loader._run is None  # its threads stopped
    with pytest.raises(SetupError, match=r"closed mid-way .*another pipeline's stream"):
        first.progress(it)
    _, pipeline, fresh = build(cached=False, steps=6)  # TorchRec: 2 steps, then a new stream of 6
    it = iter(fresh)
    expected = [float(pipeline.progress(it)[0]) for _ in range(2)]
    pipeline.reset()
    it = iter(fresh)
    with pytest.raises(StopIteration):
        while True:
            expected.append(float(pipeline.progress(it)[0]))
    assert losses == expected
    second.close()


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_cached_pipeline_equals_torchrec_resident_pipeline(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "tests.pipeline_runs", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    compared = set()
    for r in results:
        assert r["steps"] == 12 and r["losses_equal"] and r["max_dw"] == 0.0, r
        # every backward's exchange used the index the planner thread built with the step's LRPP plan
        sync = r["sync"]
        assert sync["grad_floats_sent"] > 0 and "exchanges_indexed_in_backward" not in sync, sync
        compared |= set(r["keys"])
    # every table (each whole on the rank holding it) and every dense layer compared on some rank
    assert compared == set(results[0]["all_keys"]) | set(results[1]["all_keys"])
    assert any(".embedding_bags.t_cat_2." in k for k in compared)
