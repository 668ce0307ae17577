"""Each rank trains the batches, in the order, that Lightning gives the resident job (map-style DataModules
wrapped in LookaheadDataModule get Lightning's DistributedSampler); iterable data that does not split by rank
is refused on several ranks."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict

import pytest
from torch.utils.data import DataLoader, IterableDataset

from torchrec_lookahead.data.rank_split import split_for_ranks
from torchrec_lookahead.errors import ConfigError

from ..verify_runs import launch, selected

CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  strategy:
    class_path: torchrec_lookahead.strategies.TorchRecStrategy
    init_args:
      sharders:
        - class_path: torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder
          init_args: {capacity: {t_cat_0: 120, t_cat_1: 80}}
model:
  class_path: tests.data.list_batches.ArchModule
  init_args:
    arch: ARCH
    embedding_dim: 8
    dense_arch_layer_sizes: [16, 8]
    over_arch_layer_sizes: [16, 1]
    embedding_optimizer: {name: rowwise_adagrad, lr: 0.05}
    dense_optimizer: {name: adagrad, lr: 0.05}
data:
  class_path: torchrec_lookahead.data.LookaheadDataModule
  init_args:
    datamodule: {class_path: tests.data.list_batches.ListBatchDataModule, init_args: {num_batches: NUM}}
    horizon: 4
"""

ARCHS = ["dlrm", "dcn", "deepfm"]


def _config(tmp_path: Path, arch: str, num_batches: int) -> str:
    path = tmp_path / f"{arch}.yaml"
    path.write_text(CONFIG.replace("ARCH", arch).replace("NUM", str(num_batches)))
    return str(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_rank_list_of_batches_trains_in_the_resident_order(tmp_path, arch):
    from torchrec_lookahead.verify import verify

    # 12 batches an epoch, 20 steps: the second epoch reshuffles (Lightning sets the sampler's epoch)
    result = verify(_config(tmp_path, arch, 12), steps=20)
    assert result["steps"] == 20
    assert result["max_abs_weight_diff"] == 0.0 and result["max_abs_loss_diff"] == 0.0, result


@pytest.fixture(scope="module")
def two_rank_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Dict[str, Any]:
    """The three models' 2-rank ``verify`` comparisons (16 batches an epoch, 12 steps), in one torchrun launch."""
    tmp = tmp_path_factory.mktemp("rank_split")
    runs = [
        {"name": f"test_two_ranks_each_train_their_own_batches_as_the_resident_job[{arch}]",
         "config": [_config(tmp, arch, 16)], "steps": 12, "overrides": ["--trainer.devices=2"]}
        for arch in ARCHS
    ]  # fmt: skip
    return launch(tmp, selected(request, runs), timeout=600)[0]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_each_train_their_own_batches_as_the_resident_job(
    request: pytest.FixtureRequest, two_rank_results: Dict[str, Any], arch: str
) -> None:
    result = two_rank_results[request.node.name]
    assert result["steps"] == 12
    # the same batches on every rank (the defect) differ from the resident run by 0.1 or more
    assert result["passed"] and result["max_abs_weight_diff"] == 0.0 == result["max_abs_loss_diff"], result


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(3)


class _RankStream(_Stream):
    splits_by_rank = True


def test_iterable_data_on_several_ranks_must_split_itself():
    two = SimpleNamespace(world_size=2)
    with pytest.raises(ConfigError, match=r"_Stream\) is iterable.*set splits_by_rank = True"):
        split_for_ranks(two, DataLoader(_Stream(), batch_size=None))  # type: ignore[arg-type]
    ok = DataLoader(_RankStream(), batch_size=None)
    assert split_for_ranks(two, ok) is ok  # type: ignore[arg-type]
    alone = DataLoader(_Stream(), batch_size=None)
    assert split_for_ranks(SimpleNamespace(world_size=1), alone) is alone  # type: ignore[arg-type]
