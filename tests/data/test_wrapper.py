"""The wrapped DataModule: what it passes through, and what it refuses to wrap."""

from __future__ import annotations

import pytest

from torchrec_lookahead.errors import ConfigError


def test_the_lookahead_datamodule_refuses_what_is_not_a_datamodule() -> None:
    from torchrec_lookahead.data import LookaheadDataModule

    for given, name in [(None, "NoneType"), ([1, 2], "list")]:
        with pytest.raises(ConfigError, match=f"datamodule must be a LightningDataModule .* but got {name}"):
            LookaheadDataModule(given)  # type: ignore[arg-type]
