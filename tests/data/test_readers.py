import pytest
import torch

from torchrec_lookahead import ConfigError, DataError
from torchrec_lookahead.data import CriteoTSVDataModule, MovieLensDataModule, TaobaoDataModule

from ..conftest import shared_data

GOOD = "\t".join(["1"] + ["3", "", "-2"] + ["7"] * 10 + ["68fd1e64", ""] + ["0a519c5c"] * 24)


def _write(tmp_path, name, lines):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def _batches(dm, split="train"):
    dm.setup("fit")
    return list(getattr(dm, f"{split}_dataloader")())


def test_criteo_tsv_parses_empty_and_negative_fields(tmp_path):
    path = _write(tmp_path, "a.tsv", [GOOD, GOOD.replace("1\t", "0\t", 1)])
    (b,) = _batches(CriteoTSVDataModule(path, num_embeddings=1000, batch_size=4))
    assert b.labels.tolist() == [1.0, 0.0]
    assert b.dense_features[0, :3].tolist() == pytest.approx(
        [torch.log1p(torch.tensor(3.0)).item(), 0.0, 0.0]
    )
    kjt = b.sparse_features
    assert kjt["cat_0"].values().tolist() == [int("68fd1e64", 16) % 1000] * 2
    assert kjt["cat_1"].values().tolist() == [0, 0]  # empty categorical -> id 0


@pytest.mark.parametrize(
    "bad, match",
    [
        ("\t".join(["1"] + ["3"] * 13 + ["68fd1e64"] * 25), "expected 40 tab-separated fields"),
        (GOOD.replace("68fd1e64", "zz", 1), "not hexadecimal"),
        (GOOD.replace("\t3\t", "\tthree\t", 1), "not an integer"),
        ("2" + GOOD[1:], "label must be 0 or 1"),
    ],
)
def test_criteo_tsv_malformed_line_names_file_and_line(tmp_path, bad, match):
    path = _write(tmp_path, "bad.tsv", [GOOD, GOOD, bad])
    with pytest.raises(DataError, match=match) as err:
        _batches(CriteoTSVDataModule(path, num_embeddings=100, batch_size=8))
    assert f"{path}:3:" in str(err.value)


def test_missing_file_and_bad_sizes(tmp_path):
    with pytest.raises(DataError, match="not found"):
        CriteoTSVDataModule(str(tmp_path / "nope.tsv"))
    path = _write(tmp_path, "a.tsv", [GOOD])
    with pytest.raises(ConfigError, match="positive"):
        CriteoTSVDataModule(path, num_embeddings=0)
    with pytest.raises(ConfigError, match="Unknown feature name"):
        CriteoTSVDataModule(path, num_embeddings={"cat_0": 5, "colour": 3})
    with pytest.raises(ConfigError, match="26"):
        CriteoTSVDataModule(path, num_embeddings=[10, 10])


def test_criteo_real_sample_in_file_order():
    path = shared_data("criteo_kaggle_head", "head8000_split_train.txt")
    dm = CriteoTSVDataModule(str(path), num_embeddings=10_000, batch_size=1024)
    batches = _batches(dm)
    assert len(batches) == 8  # 7,200 rows
    labels = torch.cat([b.labels for b in batches])
    assert labels.numel() == 7200 and 0.15 < labels.mean().item() < 0.3
    first = open(path).readline().split("\t")
    assert batches[0].labels[0].item() == float(first[0])
    assert batches[0].sparse_features["cat_0"].values()[0].item() == int(first[14], 16) % 10_000


def test_movielens_real_sample_with_genres():
    ratings = shared_data("movielens_latest_small_2016", "ratings.csv")
    movies = shared_data("movielens_latest_small_2016", "movies.csv")
    dm = MovieLensDataModule(str(ratings), movies_file=str(movies), batch_size=4096)
    dm.setup("fit")
    assert len(dm.train_dataloader()) == 25  # 100,004 ratings
    b = next(iter(dm.train_dataloader()))
    kjt = b.sparse_features
    assert kjt.keys() == ["user", "movie", "genres"]
    assert kjt["user"].values()[0].item() == 1 and kjt["movie"].values()[0].item() == 31
    assert kjt["genres"].lengths().max().item() > 1  # multi-hot
    assert 0.3 < b.labels.mean().item() < 0.7


def test_taobao_real_sample_labels():
    path = shared_data("taobao_userbehavior_head", "UserBehavior_head.csv")
    dm = TaobaoDataModule(str(path), batch_size=8192)
    batches = _batches(dm)
    labels = torch.cat([b.labels for b in batches])
    assert labels.numel() == 84_475
    assert labels.sum().item() == 4_497 + 2_356 + 1_750  # cart + fav + buy
    assert batches[0].sparse_features["item"].values()[0].item() == 2268318


def test_movielens_and_taobao_malformed(tmp_path):
    ml = _write(tmp_path, "r.csv", ["userId,movieId,rating,timestamp", "1,2,4.0,100", "1,x,4.0,100"])
    with pytest.raises(DataError, match=r"r.csv:3:"):
        _batches(MovieLensDataModule(ml))
    tb = _write(tmp_path, "t.csv", ["1,2,3,pv,100", "1,2,3,like,100"])
    with pytest.raises(DataError, match=r"t.csv:2: behavior must be one of"):
        _batches(TaobaoDataModule(tb))
    tb2 = _write(tmp_path, "t2.csv", ["1,2,3,pv"])
    with pytest.raises(DataError, match="expected 5"):
        _batches(TaobaoDataModule(tb2))


def test_a_line_that_is_not_utf8_is_a_data_error_in_every_reader(tmp_path):
    from torchrec_lookahead.data.readers import read_movielens_genres

    tsv = tmp_path / "bad.tsv"
    tsv.write_bytes((GOOD + "\n").encode() * 2 + b"\x80" + GOOD[1:].encode() + b"\n")
    with pytest.raises(DataError, match=rf"{tsv}:3: not UTF-8 text \(byte 0x80 at byte 1 of the line\)"):
        _batches(CriteoTSVDataModule(str(tsv), num_embeddings=100, batch_size=8))
    movies = tmp_path / "movies.csv"
    movies.write_bytes(
        "movieId,title,genres\n1,Amélie (2001),Comedy|Romance\n".encode() + b"2,\xe9t\xe9,Drama\n"
    )
    with pytest.raises(DataError, match=rf"{movies}:3: not UTF-8 text \(byte 0xe9 at byte 3 of the line\)"):
        read_movielens_genres(str(movies))
    movies.write_bytes("movieId,title,genres\n1,Amélie (2001),Comedy|Romance\n".encode())
    assert read_movielens_genres(str(movies)) == {1: [1, 2]}


def _ratings(tmp_path, *rows, header="userId,movieId,rating,timestamp"):
    return _write(tmp_path, "r.csv", ([header] if header else []) + list(rows))


@pytest.mark.parametrize(
    "row, match",
    [
        ("1,2,4.0," + "9" * 50, r"r.csv:3: timestamp must be in seconds since 1970, within \+-2\*\*40"),
        ("1,2,4.0," + "9" * 400, r"r.csv:3: timestamp .* but got '9{20}'\.\.\. \(400 characters\)$"),
        ("1,2,4.0,-" + "9" * 30, "r.csv:3: timestamp must be"),
        ("1,2,nan,100", r"r.csv:3: rating must be a number in \[0, 5\] .* but got 'nan'"),
        ("1,2,inf,100", "r.csv:3: rating must be a number in"),
        ("1,2,-3,100", "r.csv:3: rating must be a number in"),
        ("1,2,47,100", "r.csv:3: rating must be a number in"),
    ],
)
def test_movielens_out_of_range_rating_or_timestamp_is_a_data_error(tmp_path, row, match):
    path = _ratings(tmp_path, "1,2,5.0,100", row)
    with pytest.raises(DataError, match=match):
        _batches(MovieLensDataModule(path))


def test_out_of_range_criteo_integer_and_taobao_timestamp_are_data_errors(tmp_path):
    huge = GOOD.replace("\t3\t", "\t" + "9" * 400 + "\t", 1)
    path = _write(tmp_path, "bad.tsv", [GOOD, huge])
    with pytest.raises(DataError, match=r"bad.tsv:2: integer feature I1 must be a 64-bit integer \(-2\*\*63"):
        _batches(CriteoTSVDataModule(path, num_embeddings=100, batch_size=8))
    edge = GOOD.replace("\t3\t", f"\t{2**63 - 1}\t", 1).replace("\t-2\t", f"\t{-(2**63)}\t", 1)
    (b,) = _batches(CriteoTSVDataModule(_write(tmp_path, "ok.tsv", [edge]), num_embeddings=100, batch_size=8))
    assert torch.isfinite(b.dense_features).all()
    tb = _write(tmp_path, "t.csv", ["1,2,3,pv,100", "1,2,3,pv,1511544070000"])  # milliseconds
    with pytest.raises(DataError, match=r"t.csv:2: timestamp must be in seconds since 1970"):
        _batches(TaobaoDataModule(tb))
