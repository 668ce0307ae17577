"""Checkpoints of a plain TorchRec loop through ``LookaheadTrainPipeline`` (docs/getting_started.md): the model's
and the optimizer's state dicts taken mid-stream, loaded into a new model and pipeline fed the remaining
batches, train as the uninterrupted run, bit for bit."""

import copy
import itertools
from typing import Any, Iterator, List, Optional

import pytest
import torch
import torch.distributed as dist

from .conftest import free_port
from .pipeline_runs import build, whole_weights

STEPS, AT = 8, 3


@pytest.fixture(scope="module")
def pg():
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def _losses(pipeline: Any, it: Iterator[Any], n: Optional[int] = None) -> List[float]:
    out: List[float] = []
    while n is None or len(out) < n:
        try:
            out.append(float(pipeline.progress(it)[0]))
        except StopIteration:
            break
    return out


@pytest.mark.parametrize("flush_first", [False, True])
def test_a_plain_loop_checkpoint_taken_mid_stream_resumes_to_the_uninterrupted_run(pg, flush_first):
    # dropout 0: the global random stream is not part of these state dicts (a loop saves it itself)
    dmp, pipeline, data = build(cached=True, steps=STEPS, dropout=0.0, horizon=4)
    with pipeline:
        full = _losses(pipeline, iter(data))
    uninterrupted = whole_weights(dmp)

    dmp, pipeline, data = build(cached=True, steps=STEPS, dropout=0.0, horizon=4)
    with pipeline:
        first = _losses(pipeline, iter(data), AT)
        if flush_first:
            pipeline.flush()
        # mid-stream, rows still in the caches and plans read ahead: the state dict holds the trained rows
        model_state = copy.deepcopy(dmp.state_dict())
        optimizer_state = copy.deepcopy(pipeline._optimizer.state_dict())  # the loop's own optimizer

    dmp, pipeline, data = build(cached=True, steps=STEPS, dropout=0.0, horizon=4)
    dmp.load_state_dict(model_state)
    pipeline._optimizer.load_state_dict(optimizer_state)
    with pipeline:
        rest = _losses(pipeline, itertools.islice(iter(data), AT, None))
    assert len(first) == AT and first + rest == full, (first, rest, full)
    resumed = whole_weights(dmp)
    assert sorted(resumed) == sorted(uninterrupted)
    assert any(".embedding_bags.t_cat_2." in k for k in resumed)  # a cached table among them
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)
