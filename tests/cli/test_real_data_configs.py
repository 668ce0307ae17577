"""The cached configs of the real data samples (FAE ones with pinned hot rows too) train exactly like their resident
twins (a few steps each)."""

from __future__ import annotations

import pytest

from torchrec_lookahead.verify import verify

from ..conftest import REPO, shared_data

CONFIGS = {
    "avazu_lookahead": ("avazu_head", "avazu_train_head_8999.csv"),
    "criteo_tsv_lookahead": ("criteo_kaggle_head", "head8000_split_train.txt"),
    "criteo_tsv_fae": ("criteo_kaggle_head", "head8000_split_train.txt"),
    "taobao_fae": ("taobao_userbehavior_head", "UserBehavior_head.csv"),
    "movielens_lookahead": ("movielens_latest_small_2016", "ratings.csv"),
    "movielens_sequence_lookahead": ("movielens_latest_small_2016", "ratings.csv"),
    "taobao_lookahead": ("taobao_userbehavior_head", "UserBehavior_head.csv"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_real_data_config_equals_resident(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    shared_data(*CONFIGS[name])
    monkeypatch.chdir(REPO)  # the configs name ../shared/data relative to the repository
    out = verify(str(REPO / "configs" / f"{name}.yaml"), steps=6)
    assert out["passed"] and out["max_abs_weight_diff"] == 0.0 and out["steps"] == 6, out
