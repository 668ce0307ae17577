"""Two gloo ranks under torchrun: fit, mid-epoch checkpoint/resume, faults and restarts. (A device count that does not
match torchrun's is refused when the Trainer is built: ``tests/strategies/test_torchrec_strategy.py``.)"""

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Sequence, Tuple

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ..cli.test_cli import clean_env, run_cli
from ..conftest import REPO, free_port
from ..verify_runs import launch, selected

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def torchrun(
    nproc: int, *args: str, timeout: int = 400, launcher: Sequence[str] = ()
) -> subprocess.CompletedProcess:
    rdzv = list(launcher) or [f"--master_port={free_port()}"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        *rdzv,
        "-m",
        "torchrec_lookahead",
        *args,
    ]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=clean_env())


def _ckpt_args(dirpath: Path, every: int) -> list:
    return [
        "--trainer.callbacks+=ModelCheckpoint",
        f"--trainer.callbacks.dirpath={dirpath}",
        f"--trainer.callbacks.every_n_train_steps={every}",
        "--trainer.callbacks.save_top_k=-1",
    ]


def _assert_same_final_weights(a_ckpt: Path, b_ckpt: Path, tmp_path: Path) -> None:
    """The runs that checkpointed into ``a_ckpt`` and ``b_ckpt`` ended (step 12) with the same full weights,
    cached tables included."""
    a = _full_state(a_ckpt / "epoch=0-step=12.ckpt", tmp_path)
    b = _full_state(b_ckpt / "epoch=0-step=12.ckpt", tmp_path)
    cached = [k for k in a if ".cache.embedding_bags." in k and k.endswith(".weight")]
    assert cached and a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _full_state(ckpt: Path, tmp: Path) -> Dict[str, torch.Tensor]:
    out = tmp / (ckpt.name + ".pt")
    dcp_to_torch_save(ckpt, out)
    state = torch.load(out, weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def test_two_ranks_fit_checkpoint_and_resume_the_same_trajectory(tmp_path):
    common = [
        "fit",
        "--config",
        "configs/dlrm_tiny.yaml",
        "--trainer.devices=2",
        "--trainer.limit_val_batches=0",
    ]
    full = torchrun(2, *common, "--trainer.max_steps=8", f"--trainer.default_root_dir={tmp_path}/a",
                    *_ckpt_args(tmp_path / "a_ckpt", 4))  # fmt: skip
    assert full.returncode == 0, full.stderr[-4000:]
    mid = tmp_path / "a_ckpt" / "epoch=0-step=4.ckpt"
    end_full = tmp_path / "a_ckpt" / "epoch=0-step=8.ckpt"
    assert mid.is_dir() and end_full.is_dir()
    # every rank wrote its own shard files
    assert len(list(mid.glob("*.distcp"))) == 2
    resumed = torchrun(2, *common, "--trainer.max_steps=8", f"--trainer.default_root_dir={tmp_path}/b",
                       f"--ckpt_path={mid}", *_ckpt_args(tmp_path / "b_ckpt", 4))  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    a = _full_state(end_full, tmp_path)
    b = _full_state(tmp_path / "b_ckpt" / "epoch=0-step=8.ckpt", tmp_path)
    assert a.keys() == b.keys() and any("embedding_bags" in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the tables are not empty: both ranks' shards are in the checkpoint
    emb = [v for k, v in a.items() if "embedding_bags" in k]
    assert all(v.abs().sum() > 0 for v in emb)
    # the same checkpoint resumed on one rank: refused, in one short line that says what to do
    one = run_cli("fit", "--config", "configs/dlrm_tiny.yaml", "--trainer.limit_val_batches=0",
                  "--trainer.max_steps=8", f"--trainer.default_root_dir={tmp_path}/c",
                  f"--ckpt_path={mid}")  # fmt: skip
    assert one.returncode == 1
    assert (
        "CheckpointError: checkpoint" in one.stderr and "written by 2 ranks but this run has 1" in one.stderr
    )
    assert "Traceback" not in one.stderr, one.stderr[-3000:]


_SHARDER = (
    "--trainer.strategy.init_args.sharders=[{class_path: torchrec_lookahead.distributed."
    "LookaheadEmbeddingBagCollectionSharder, init_args: {capacity: {t_cat_2: 140, t_cat_11: 120, "
    "t_cat_15: 110}, %s}}]"
)
_ROW_WISE = _SHARDER % "store_sharding: row_wise"


def _verify_run(name: str, steps: int, *overrides: str, tolerance: float = 0.0) -> Dict[str, Any]:
    args = ["--trainer.devices=2", *overrides]
    config = ["configs/dlrm_tiny_lookahead.yaml"]
    return {"name": name, "config": config, "steps": steps, "overrides": args, "tolerance": tolerance}


#: The ``verify`` comparisons of this file, one launch for all (``tests/verify_runs.py``): runs that differ only in
#: their lookahead sharder share one resident run. The two stopped mid-epoch come last, so that the launch's exit
#: is the one that follows a mid-epoch stop.
VERIFY_RUNS = [
    *(
        _verify_run(f"test_two_rank_lrpp_cache_equals_torchrec_resident_training[{opt}]", 24,
                    f"--model.init_args.embedding_optimizer.name={opt}")
        for opt in ("sgd", "rowwise_adagrad")
    ),
    _verify_run("test_two_rank_cdlrm_mode_trains_and_is_exact_for_sgd_averaged_every_step", 24,
                "--model.init_args.embedding_optimizer.name=sgd", _SHARDER % "cdlrm_average_every: 1",
                tolerance=1e-5),
    *(
        _verify_run(f"test_two_rank_cache_over_row_sharded_stores_equals_torchrec_resident_training[{opt}]", 24,
                    f"--model.init_args.embedding_optimizer.name={opt}", _ROW_WISE)
        for opt in ("sgd", "rowwise_adagrad")
    ),
    _verify_run("test_two_rank_cached_run_stopped_mid_epoch_exits_cleanly_and_equals_torchrec", 17),
    _verify_run(
        "test_two_rank_run_over_row_sharded_stores_stopped_mid_epoch_exits_cleanly_and_equals_torchrec", 17,
        _ROW_WISE,
    ),
]  # fmt: skip


@pytest.fixture(scope="module")
def verified(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tuple[Dict, Any]:
    """Each selected comparison's result by test name, and the launch (its exit status and output)."""
    return launch(tmp_path_factory.mktemp("verify"), selected(request, VERIFY_RUNS), timeout=900)


def _result(request: pytest.FixtureRequest, verified: Tuple[Dict, Any]) -> Dict[str, Any]:
    result = verified[0][request.node.name]
    assert result["passed"], result
    return result


def test_two_rank_cached_run_stopped_mid_epoch_exits_cleanly_and_equals_torchrec(request, verified):
    """max_steps in the middle of the second epoch (12 batches per epoch): the planner threads stop their id
    all-gathers in lockstep, the process exits with status 0, and the flushed weights equal TorchRec's resident
    2-rank DMP run stopped at the same step."""
    result = _result(request, verified)
    assert result["steps"] == 17 and result["max_abs_weight_diff"] == 0.0, result
    assert "was not joined" not in verified[1].stderr


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_two_rank_lrpp_cache_equals_torchrec_resident_training(request, verified, optimizer):
    """verify: the cached model on 2 ranks (LRPP) against TorchRec's own 2-rank DMP training."""
    result = _result(request, verified)
    assert result["max_abs_weight_diff"] == 0.0 and result["steps"] == 24, result


_CACHED_FIT = ["fit", "--config", "configs/dlrm_tiny_lookahead.yaml", "--trainer.devices=2",
               "--trainer.limit_val_batches=0", "--trainer.max_steps=12"]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 2-rank cached fit of 12 steps that the resume and fault tests end equal to, with a
    checkpoint every 2 steps (the resume test starts from step 6, the fault tests' last checkpoint is step 4):
    ``<dir>/a_ckpt/epoch=0-step=<n>.ckpt``."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    full = torchrun(2, *_CACHED_FIT, f"--trainer.default_root_dir={tmp}/a", *_ckpt_args(tmp / "a_ckpt", 2))
    assert full.returncode == 0, full.stderr[-4000:]
    return tmp


def test_two_rank_cached_checkpoint_resumes_the_same_weights(tmp_path, uninterrupted):
    resumed = torchrun(2, *_CACHED_FIT, f"--trainer.default_root_dir={tmp_path}/b",
                       f"--ckpt_path={uninterrupted / 'a_ckpt' / 'epoch=0-step=6.ckpt'}",
                       *_ckpt_args(tmp_path / "b_ckpt", 6))  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    _assert_same_final_weights(uninterrupted / "a_ckpt", tmp_path / "b_ckpt", tmp_path)


def test_two_rank_cdlrm_mode_trains_and_is_exact_for_sgd_averaged_every_step(request, verified):
    """cDLRM's scheme (local updates, caches averaged every lambda steps) is approximate by design; with SGD
    averaged every step it reduces to the exact update up to rounding (the mean of two updated rows is not
    the row updated by the mean gradient, bit for bit), which pins the averaging machinery."""
    assert _result(request, verified)["steps"] == 24


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_two_rank_cache_over_row_sharded_stores_equals_torchrec_resident_training(
    request, verified, optimizer
):
    """Each rank holds half of every cached table's rows and reaches the other half with collectives (the
    stager's gathers on a group of their own): still exactly TorchRec's 2-rank DMP training."""
    result = _result(request, verified)
    assert result["max_abs_weight_diff"] == 0.0 and result["steps"] == 24, result


def test_two_rank_run_over_row_sharded_stores_stopped_mid_epoch_exits_cleanly_and_equals_torchrec(
    request, verified
):
    """max_steps in the middle of the second epoch over row-sharded stores: the stagers' row gathers (collectives)
    stop in lockstep like the planners' id all-gathers, the process exits with status 0, and the flushed weights
    equal TorchRec's resident 2-rank DMP run stopped at the same step."""
    result = _result(request, verified)
    assert result["steps"] == 17 and result["max_abs_weight_diff"] == 0.0, result
    assert "was not joined" not in verified[1].stderr and "did not stop" not in verified[1].stderr


def test_two_hosts_shard_the_stores_by_host_and_equal_torchrec_resident_training():
    """Two torchrun launchers of one rank each (two "hosts"): the default store_sharding='host' shards the
    cached tables over the hosts (formerly refused), and training still equals TorchRec's."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
           "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "torchrec_lookahead", "verify",
           "--config", "configs/dlrm_tiny_lookahead.yaml", "--trainer.devices=1", "--trainer.num_nodes=2",
           "--steps", "12"]  # fmt: skip
    procs = [
        subprocess.Popen(
            cmd[:5] + [f"--node_rank={i}"] + cmd[5:],
            cwd=REPO,
            env=clean_env(),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for i in range(2)
    ]
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (_stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr[-4000:]
    result = json.loads(outs[0][0].strip().splitlines()[-1])
    assert result["passed"] and result["max_abs_weight_diff"] == 0.0, result


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_a_rank_killed_under_max_restarts_resumes_from_the_last_checkpoint_with_nothing_lost(
    tmp_path, uninterrupted, rendezvous
):
    """Rank 1 is SIGKILLed after step 6 of 12 in the first attempt; torchrun restarts both ranks, which resume
    from the last checkpoint (step 4) with ``--ckpt_path=last`` and end with the weights of an uninterrupted
    run. Under both rendezvous torchrun hands the restarted attempt the first attempt's store: the strategy
    sets the restarted process group up under a prefix of its own (docs/design.md, resilience)."""
    launcher = [f"--master_port={free_port()}"] if rendezvous == "static" else ["--standalone"]
    ckpt = [*_ckpt_args(tmp_path / "b_ckpt", 4), "--trainer.callbacks.save_last=true"]
    killed = torchrun(2, *_CACHED_FIT, "--ckpt_path=last", f"--trainer.default_root_dir={tmp_path}/b", *ckpt,
                      "--trainer.callbacks+=tests.strategies.faults.KillAtStep", "--trainer.callbacks.step=6",
                      launcher=[*launcher, "--max-restarts=1"], timeout=120)  # fmt: skip
    assert killed.returncode == 0, killed.stderr[-4000:]
    # The first attempt failed: torchrun reports the first failure it sees, rank 1's SIGKILL (exitcode -9) or
    # rank 0 failing on the dead peer's connection (exitcode 1), whichever its monitor catches first.
    assert re.search(r"failed \(exitcode: (-9|1)\) local_rank", killed.stderr), killed.stderr[-6000:]
    assert "Restored all states from the checkpoint" in killed.stdout + killed.stderr
    _assert_same_final_weights(uninterrupted / "a_ckpt", tmp_path / "b_ckpt", tmp_path)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_checkpoint_in_memory_row_shards_as_deltas_and_resume_from_an_older_one(tmp_path):
    """incremental_ram_stores over row-sharded RAM stores: each rank's checkpoints are a chain of deltas of its
    shard; resuming from an older checkpoint of the chain ends where the uninterrupted run ends, table by table
    (`export` reads both ranks' chains)."""
    from torchrec_lookahead.export import _load_whole
    from torchrec_lookahead.strategies._checkpoint import read_chain

    common = ["fit", "--config", "configs/dlrm_tiny_lookahead.yaml", "--trainer.devices=2",
              "--trainer.limit_val_batches=0", "--trainer.max_steps=12", _ROW_WISE,
              "--trainer.strategy.init_args.incremental_ram_stores=true",
              "--trainer.strategy.init_args.full_checkpoint_every=4"]  # fmt: skip
    full = torchrun(
        2, *common, f"--trainer.default_root_dir={tmp_path}/a", *_ckpt_args(tmp_path / "a_ckpt", 4)
    )
    assert full.returncode == 0, full.stderr[-4000:]
    older = tmp_path / "a_ckpt" / "epoch=0-step=8.ckpt"
    assert [len(read_chain(older, r, "embedding_bags.t_cat_2")) for r in (0, 1)] == [
        2,
        2,
    ]  # deltas over step 4
    resumed = torchrun(2, *common, f"--trainer.default_root_dir={tmp_path}/b", f"--ckpt_path={older}",
                       *_ckpt_args(tmp_path / "b_ckpt", 4))  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    a, b = (_load_whole(tmp_path / f"{r}_ckpt" / "epoch=0-step=12.ckpt")["state_dict"] for r in "ab")
    assert any(k.endswith("embedding_bags.t_cat_2.weight") for k in a) and a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
