"""``LookaheadTrainPipeline``: a plain TorchRec loop through the cache equals TorchRec's resident loop bit for
bit (one rank in-process, two under torchrun), streams its data, and refuses what it cannot train."""

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from torchrec_lookahead import ConfigError, LookaheadTrainPipeline

from .cli.test_cli import clean_env
from .conftest import REPO, free_port
from .pipeline_runs import compare, train


@pytest.fixture(scope="module")
def pg():
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def test_one_rank_cached_pipeline_equals_torchrec_resident_pipeline(pg):
    resident = train(cached=False)
    cached = train(cached=True)
    result = compare(cached, resident)
    assert result["steps"] == 12 and result["losses_equal"], (cached["losses"], resident["losses"])
    assert sorted(resident["weights"]) == result["keys"]  # every table and dense layer compared
    assert result["max_dw"] == 0.0


def test_bad_settings_are_refused_before_anything_runs():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="prefetch_depth=5"):
        LookaheadTrainPipeline(model, opt, torch.device("cpu"), horizon=4, prefetch_depth=5)
    with pytest.raises(ConfigError, match=r"policy in \[.*'belady'.*\] but got 'fifo'"):
        LookaheadTrainPipeline(model, opt, torch.device("cpu"), policy="fifo")


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
        compared |= set(r["keys"])
    # every table (each whole on the rank holding it) and every dense layer compared on some rank
    assert compared == set(results[0]["all_keys"]) | set(results[1]["all_keys"])
    assert any(".embedding_bags.t_cat_2." in k for k in compared)
