"""Models that draw random numbers in their forward pass (dropout) train bit for bit through the cache.

Dropout's masks come from torch's global random stream, so the cached fit must see, at every step, the stream
the resident fit sees: the library's set-up puts back what it draws (TorchRec's initial values of the tables it
builds, which depend on the plan), its threads draw nothing, and the wrapped loader's iterator (a
``DataLoader`` draws its base seed when it is created) starts on the training thread, where a resident loop
starts it. The whole-epoch runs at the default job's size are in ``tests/distributed/test_exact_multirank.py``
(2 ranks), ``tests/fae/test_lookahead*.py`` (FAE, 1 and 2 ranks) and
``tests/distributed/test_disk_tier.py`` (1 rank, over disk stores).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, List, Optional

import pytest
import torch
import yaml
from torch.utils.data import DataLoader
from torchrec.models.experimental.transformerdlrm import DLRM_Transformer
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_lookahead import preserved_rng
from torchrec_lookahead.models import DLRMModule
from torchrec_lookahead.verify import verify

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "dlrm_tiny_lookahead.yaml"


class TransformerDLRMModule(DLRMModule):
    """TorchRec's own ``DLRM_Transformer`` (its ``nn.TransformerEncoderLayer`` s have dropout 0.1) under the
    bundled DLRM's LightningModule."""

    def __init__(self, *args: Any, nhead: int = 2, layers: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nhead, self.layers = nhead, layers

    def build_model(
        self, device: torch.device, dense_device: Optional[torch.device] = None
    ) -> DLRM_Transformer:
        return DLRM_Transformer(
            embedding_bag_collection=EmbeddingBagCollection(tables=self.tables, device=device),
            dense_in_features=self.num_dense_features,
            dense_arch_layer_sizes=self.dense_arch_layer_sizes,
            over_arch_layer_sizes=self.over_arch_layer_sizes,
            nhead=self.nhead,
            ntransformer_layers=self.layers,
            dense_device=dense_device or device,
        )


def _config(tmp_path: Path, model: str) -> str:
    cfg = yaml.safe_load(TINY.read_text())
    cfg["model"]["class_path"] = model
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.slow
def test_torchrecs_transformer_dlrm_with_dropout_is_bit_exact_over_the_epoch(tmp_path: Path) -> None:
    """Failed before (0.48 after 30 steps at the issue's size; 0.46 here): set-up and the planner thread drew
    from the global stream where the resident fit does not."""
    result = verify(_config(tmp_path, f"{__name__}.TransformerDLRMModule"), steps=12)  # the whole epoch
    assert result["steps"] == 12, result
    assert result["max_abs_weight_diff"] == 0.0 and result["max_abs_loss_diff"] == 0.0, result


@pytest.mark.slow
def test_dense_dropout_is_bit_exact_and_changes_the_training() -> None:
    exact = verify(str(TINY), steps=12, overrides=["--model.init_args.dropout=0.3"])
    assert exact["max_abs_weight_diff"] == 0.0 and exact["max_abs_loss_diff"] == 0.0, exact
    # the check can fail: dropout is drawn, so a run without it differs
    plain = DLRMModule({"cat_0": 10}, num_dense_features=2, embedding_dim=4, dense_arch_layer_sizes=[4])
    dropped = DLRMModule(
        {"cat_0": 10}, num_dense_features=2, embedding_dim=4, dense_arch_layer_sizes=[4], dropout=0.5
    )
    for m in (plain, dropped):
        torch.manual_seed(0)
        m.configure_model()
    dense = torch.ones(64, 2)
    assert not torch.equal(plain.model.dense_arch(dense), dropped.model.dense_arch(dense))
    dropped.model.eval()
    assert torch.equal(plain.model.dense_arch(dense), dropped.model.dense_arch(dense))


@pytest.mark.parametrize("bad", [-0.1, 1.0, True])
def test_dropout_outside_zero_one_is_refused(bad: Any) -> None:
    from torchrec_lookahead.errors import ConfigError

    with pytest.raises(ConfigError, match="dropout"):
        DLRMModule(
            {"cat_0": 10}, num_dense_features=2, embedding_dim=4, dense_arch_layer_sizes=[4], dropout=bad
        )


class _Recorded:
    """A loader recording the thread that creates its iterator and reads its first batch; creating it draws
    from the global stream, as a ``DataLoader`` does."""

    def __init__(self, batches: List[Any]) -> None:
        self.batches = batches
        self.threads: List[int] = []

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        torch.empty((), dtype=torch.int64).random_()
        self.threads.append(threading.get_ident())
        for b in self.batches:
            self.threads.append(threading.get_ident())
            yield b


def test_the_wrapped_loaders_iterator_starts_on_the_training_thread() -> None:
    """The planner thread created it before, racing with the training thread's dropout draws."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_lookahead.oracle import LookaheadSettings
    from torchrec_lookahead.runtime import CacheSession, CacheTarget, LookaheadLoader
    from torchrec_lookahead.store import TensorStore

    def batch(ids: List[int]) -> Batch:
        kjt = KeyedJaggedTensor(["f"], torch.tensor(ids), lengths=torch.ones(len(ids), dtype=torch.int32))
        return Batch(torch.zeros(len(ids), 1), kjt, torch.zeros(len(ids)))

    inner = _Recorded([batch([1, 2]), batch([2, 3]), batch([4, 1])])
    target = CacheTarget(
        capacity={"t": 4},
        feature_to_table={"f": "t"},
        num_embeddings={"t": 10},
        stores={"t": TensorStore(10, 4, name="t")},
    )
    loader = LookaheadLoader(inner, CacheSession(target), LookaheadSettings(horizon=4))
    it = iter(loader)
    first = next(it)
    assert inner.threads[:2] == [threading.get_ident()] * 2  # created, and the first batch read, here
    assert first.plan is not None and len([first, *it]) == 3
    loader.close()


def test_preserved_rng_puts_back_every_global_stream() -> None:
    import random

    import numpy as np

    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    with preserved_rng():
        [b.tolist() for b in DataLoader(list(range(8)), batch_size=2, shuffle=True)]
        torch.rand(4), np.random.rand(2), random.random()
    assert torch.equal(before[0], torch.get_rng_state())
    assert (before[1] == np.random.get_state()[1]).all() and before[2] == random.getstate()
