from types import SimpleNamespace

import torch

from torchrec_lookahead.callbacks import PredictionWriter


def test_predictions_are_concatenated_in_batch_order_one_file_per_rank(tmp_path):
    writer = PredictionWriter(str(tmp_path / "out" / "p.pt"))
    batches = [torch.tensor([0.1, 0.2]), torch.tensor([[0.3]])]
    writer.write_on_epoch_end(SimpleNamespace(global_rank=0, world_size=1), None, batches, None)
    assert torch.equal(torch.load(tmp_path / "out" / "p.pt"), torch.tensor([0.1, 0.2, 0.3]))
    # several dataloaders: a list per dataloader; several ranks: a file per rank
    writer.write_on_epoch_end(
        SimpleNamespace(global_rank=1, world_size=2), None, [batches, batches[:1]], None
    )
    assert torch.equal(torch.load(tmp_path / "out" / "p.rank1.pt"), torch.tensor([0.1, 0.2, 0.3, 0.1, 0.2]))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["p.pt", "p.rank1.pt"]
