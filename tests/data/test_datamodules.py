"""The file-backed DataModules' splits: a split without files is refused when a loader asks for it, with the fix."""

from __future__ import annotations

import pytest

from torchrec_lookahead import ConfigError
from torchrec_lookahead.data import CriteoTSVDataModule

from .test_readers import GOOD, _write


def test_a_split_without_files_says_how_to_do_without_it(tmp_path):
    dm = CriteoTSVDataModule(_write(tmp_path, "a.tsv", [GOOD] * 4), num_embeddings=100, batch_size=2)
    dm.setup("fit")
    assert len(list(dm.train_dataloader())) == 2
    with pytest.raises(
        ConfigError, match=r"no 'val' data; .* or turn validation off \(trainer.limit_val_batches: 0\)"
    ):
        dm.val_dataloader()
    with pytest.raises(ConfigError, match=r"no 'test' data; configure files or batches for it$"):
        dm.test_dataloader()
