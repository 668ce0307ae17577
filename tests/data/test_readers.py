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


def test_movielens_columns_are_found_by_their_header_names(tmp_path):
    rows = ["7,31,4.5,1260759144", "8,29,2.0,1260759145"]
    (want,) = _batches(MovieLensDataModule(_ratings(tmp_path, *rows), batch_size=4))
    moved = [",".join([f"x{m}", t, m, u, r]) for u, m, r, t in (r.split(",") for r in rows)]
    path = _ratings(tmp_path, *moved, header="extra,timestamp,movieId,userId,rating")
    (got,) = _batches(MovieLensDataModule(path, batch_size=4))
    assert got.sparse_features["user"].values().tolist() == [7, 8]
    for a, b in ((got.dense_features, want.dense_features), (got.labels, want.labels)):
        assert torch.equal(a, b)
    assert torch.equal(got.sparse_features.values(), want.sparse_features.values())
    path = _ratings(tmp_path, "1,31,4.5,1260759144,x", "1,31,4.5", header="userId,movieId,rating,timestamp,x")
    with pytest.raises(
        DataError, match=r"r.csv:3: expected 5 comma-separated fields \(as in the header line\)"
    ):
        MovieLensDataModule(path).setup("fit")  # found when the rows are counted


@pytest.mark.parametrize(
    "header, match",
    [
        (
            None,
            r"r.csv:1: the first line '1,2,4.0,100' is not MovieLens's header line; a MovieLens ratings file ",
        ),
        ("userId,movieId,rating", "r.csv:1: the first line lacks the column.s. timestamp; .* header line "),
        ("userId\tmovieId\trating\ttimestamp", "holds tabs: MovieLens files are comma-separated"),
    ],
)
def test_movielens_file_without_its_header_line_is_a_data_error(tmp_path, header, match):
    path = _ratings(tmp_path, "1,2,4.0,100", "1,3,4.0,100", header=header)
    with pytest.raises(DataError, match=match) as err:
        MovieLensDataModule(path).setup("fit")
    assert str(err.value).endswith("userId,movieId,rating,timestamp (columns in any order): add it")


def test_movies_file_header_is_read_and_an_empty_one_refused(tmp_path):
    from torchrec_lookahead.data.readers import read_movielens_genres

    movies = tmp_path / "movies.csv"
    movies.write_text('genres,x,movieId,title\nComedy|Drama,a,5,"Film, The (1999)"\nDrama,b,6,B\n')
    assert read_movielens_genres(str(movies)) == {5: [1, 2], 6: [2]}
    movies.write_text("1,Toy Story (1995),Comedy\n")
    with pytest.raises(DataError, match=r"movies.csv:1: the first line .* is not MovieLens's header line"):
        read_movielens_genres(str(movies))
    for text in ("", "movieId,title,genres\n"):
        movies.write_text(text)
        with pytest.raises(DataError, match=rf"{movies}: the movies file (is empty|holds no movies)"):
            read_movielens_genres(str(movies))


def test_a_rated_movie_missing_from_the_movies_file_is_a_data_error_naming_it(tmp_path):
    """It silently had genre 0, as if no movies file were given."""
    from torchrec_lookahead.data import MovieLensHistoryDataModule

    movies = tmp_path / "movies.csv"
    movies.write_text("movieId,title,genres\n5,A,Comedy\n6,B,Drama\n")
    ratings = _ratings(tmp_path, "1,5,4.0,100", "1,7,4.0,101", "2,8,3.0,102", "2,6,3.0,103")
    for make in (MovieLensDataModule, MovieLensHistoryDataModule):
        with pytest.raises(DataError, match=rf"r.csv:3: movieId 7 is not in the movies file {movies}; give"):
            _batches(make(ratings, movies_file=str(movies), batch_size=2))
    assert len(_batches(MovieLensDataModule(ratings, batch_size=2))) == 2  # no movies file: genre 0


@pytest.mark.parametrize(
    "make, lines, match",
    [
        (
            lambda p: CriteoTSVDataModule(p, num_embeddings=100, batch_size=2),
            ["\t".join(["label"] + [f"I{k}" for k in range(1, 14)] + [f"C{k}" for k in range(1, 27)]), GOOD],
            "x:1: the first line starts with 'label', a header line, but Criteo TSV files have none: remove it",
        ),
        (
            lambda p: TaobaoDataModule(p, batch_size=2),
            ["user_id,item_id,category_id,behavior,timestamp", "1,2,3,pv,100"],
            "x:1: the first line starts with 'user_id', a header line, but Taobao UserBehavior files have none",
        ),
    ],
)
def test_a_header_line_where_the_format_has_none_is_a_data_error(tmp_path, make, lines, match):
    path = _write(tmp_path, "x", lines)
    with pytest.raises(DataError, match=match):
        make(path).setup("fit")


@pytest.mark.parametrize(
    "make, head, good, bad, match",
    [
        (
            lambda p: CriteoTSVDataModule(p, num_embeddings=100, batch_size=2),
            [],
            GOOD,
            GOOD + "\t1",
            "expected 40 tab-separated fields (label, 13 integer, 26 categorical) but got 41; is this the Criteo TSV "
            "format?",
        ),
        (
            lambda p: MovieLensDataModule(p, batch_size=2),
            ["userId,movieId,rating,timestamp"],
            "1,2,4.0,100",
            "1,2,4.0",
            "expected 4 comma-separated fields (userId,movieId,rating,timestamp) but got 3",
        ),
        (
            lambda p: TaobaoDataModule(p, batch_size=2),
            [],
            "1,2,3,pv,100",
            "1,2,3,pv",
            "expected 5 comma-separated fields (user_id,item_id,category_id,behavior,timestamp) but got 4",
        ),
    ],
)
def test_a_late_line_with_a_wrong_field_count_is_found_when_the_rows_are_counted(
    tmp_path, make, head, good, bad, match
):
    from torchrec_lookahead.data.text import LineBatchDataset

    path = _write(tmp_path, "x", head + [good] * 5000 + [bad] + [good] * 10)
    dm = make(path)
    with pytest.raises(DataError) as counted:
        dm.setup("fit")  # before any batch is read
    assert str(counted.value) == f"{path}:{len(head) + 5001}: {match}"
    reading = LineBatchDataset([path], dm._parser(), 2, delimiter=dm.delimiter, num_rows=5011)
    with pytest.raises(DataError) as read:
        list(reading)  # the reading pass (rows not counted) says the same
    assert str(read.value) == str(counted.value)
