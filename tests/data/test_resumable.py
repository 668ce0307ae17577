import torch

from torchrec_lookahead.data import CriteoSyntheticDataset, ResumableBatchLoader, SyntheticCriteoConfig

from ..conftest import TINY_TABLES


def test_loader_resumes_where_it_stopped():
    cfg = SyntheticCriteoConfig(batch_size=8, num_batches=5, num_embeddings=TINY_TABLES)
    full = [b.labels for b in ResumableBatchLoader(CriteoSyntheticDataset(cfg))]
    loader = ResumableBatchLoader(CriteoSyntheticDataset(cfg))
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert state == {"batches_yielded": 2}
    fresh = ResumableBatchLoader(CriteoSyntheticDataset(cfg))
    fresh.load_state_dict(state)
    rest = [b.labels for b in fresh]
    assert len(rest) == 3 and all(torch.equal(a, b) for a, b in zip(rest, full[2:]))
    # the following epoch starts from the beginning again
    assert len(list(fresh)) == 5
