"""MovieLens rating histories: time order, only earlier ratings, the same rows whichever rank reads them."""

import pytest

from torchrec_lookahead import ConfigError, DataError
from torchrec_lookahead.data import MovieLensHistoryDataModule

from ..conftest import shared_data

RATINGS = """userId,movieId,rating,timestamp
1,10,4.0,300
1,11,2.0,100
2,10,5.0,200
1,12,4.5,200
2,13,1.0,50
1,14,3.0,400
"""


def _rows(dm: MovieLensHistoryDataModule):
    out = []
    for b in dm.train_dataloader():
        d = b.sparse_features.to_dict()
        hist = d["history"].to_dense()
        for u, m, h, y in zip(d["user"].values(), d["movie"].values(), hist, b.labels):
            out.append((int(u), int(m), h.tolist(), float(y)))
    return out


def test_histories_hold_the_users_earlier_movies_oldest_first_in_time_order(tmp_path):
    path = tmp_path / "ratings.csv"
    path.write_text(RATINGS)
    dm = MovieLensHistoryDataModule(str(path), history_length=2, batch_size=4)
    assert dm.num_embeddings_per_feature["history"] == dm.num_embeddings_per_feature["movie"]
    assert _rows(dm) == [
        (2, 13, [], 0.0),  # t=50
        (1, 11, [], 0.0),  # t=100
        (2, 10, [13], 1.0),  # t=200, file order among equal times
        (1, 12, [11], 1.0),
        (1, 10, [11, 12], 1.0),  # t=300
        (1, 14, [12, 10], 0.0),  # t=400: the two most recent
    ]
    no_history = MovieLensHistoryDataModule(str(path), history_length=0, batch_size=4)
    assert all(h == [] for *_, h, _ in _rows(no_history))


def test_two_ranks_read_the_single_rank_rows_with_the_same_histories(tmp_path):
    path = tmp_path / "ratings.csv"
    path.write_text(RATINGS)
    whole = _rows(MovieLensHistoryDataModule(str(path), history_length=3, batch_size=6))
    parts = []
    for rank in range(2):
        dm = MovieLensHistoryDataModule(str(path), history_length=3, batch_size=3)
        dm._datasets["train"] = dm._make_dataset("train", 2, rank)
        parts.append(_rows(dm))
    assert parts[0] + parts[1] == whole


def test_bad_rows_and_arguments_are_refused_with_the_file_and_line(tmp_path):
    path = tmp_path / "ratings.csv"
    path.write_text("userId,movieId,rating,timestamp\n1,2,3.0\n")
    with pytest.raises(DataError, match=r"ratings.csv:2: expected 4"):
        next(iter(MovieLensHistoryDataModule(str(path), batch_size=2).train_dataloader()))
    with pytest.raises(ConfigError, match="history_length must be an integer >= 0 but got -1"):
        MovieLensHistoryDataModule(str(path), history_length=-1)


def test_real_sample_histories_are_in_time_order():
    path = shared_data("movielens_latest_small_2016", "ratings.csv")
    dm = MovieLensHistoryDataModule(str(path), history_length=5, batch_size=4096)
    batch = next(iter(dm.train_dataloader()))
    times = batch.dense_features[:, 0]
    assert bool((times[1:] >= times[:-1]).all())
    lengths = batch.sparse_features["history"].lengths()
    assert int(lengths.max()) == 5 and int(lengths.min()) == 0
    assert batch.sparse_features.keys() == ["user", "movie", "genres", "history"]


def test_columns_in_another_order_give_the_same_histories(tmp_path):
    path = tmp_path / "ratings.csv"
    path.write_text(RATINGS)
    want = _rows(MovieLensHistoryDataModule(str(path), history_length=2, batch_size=4))
    lines = [line.split(",") for line in RATINGS.splitlines()]
    path.write_text("".join(f"{r},{t},{m},{u}\n" for u, m, r, t in lines))
    assert _rows(MovieLensHistoryDataModule(str(path), history_length=2, batch_size=4)) == want
