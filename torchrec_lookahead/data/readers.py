"""Parsers of real data sets into TorchRec batches: Criteo TSV, MovieLens ratings, Taobao UserBehavior, Avazu.

Each parser turns rows (this rank's slice of a global batch) into a :class:`~torchrec.datasets.utils.Batch`
and refuses a malformed row with a :class:`~torchrec_lookahead.errors.DataError` naming its file and line.

Example:
    >>> from torchrec_lookahead.data.text import Row
    >>> parse = CriteoTSVParser(num_embeddings=[100] * 26)
    >>> fields = ["1"] + ["3"] * 13 + ["68fd1e64"] * 26
    >>> b = parse([Row(fields, "x.tsv", 1)])
    >>> tuple(b.dense_features.shape), b.labels.tolist()
    ((1, 13), [1.0])
"""

from __future__ import annotations

import datetime
import math
from typing import Dict, List, Optional, Sequence

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead._checks import is_int
from torchrec_lookahead.data.criteo_spec import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES, INT_FEATURE_COUNT
from torchrec_lookahead.data.text import Header, LineFormat, Row
from torchrec_lookahead.errors import ConfigError, DataError

__all__ = [
    "AvazuParser",
    "CriteoTSVParser",
    "MovieLensParser",
    "TaobaoParser",
    "MOVIELENS_FEATURES",
    "TAOBAO_FEATURES",
    "TAOBAO_POSITIVE",
    "AVAZU_FEATURES",
]

MOVIELENS_FEATURES = ["user", "movie", "genres"]
TAOBAO_FEATURES = ["user", "item", "category"]
TAOBAO_BEHAVIOURS = ("pv", "buy", "cart", "fav")
TAOBAO_POSITIVE = frozenset({"buy", "cart", "fav"})
MOVIELENS_COLUMNS = ("userId", "movieId", "rating", "timestamp")
MOVIES_COLUMNS = ("movieId", "title", "genres")
#: Avazu's categorical columns: hashed ids written as hexadecimal, and integers
AVAZU_HEX = (
    "site_id",
    "site_domain",
    "site_category",
    "app_id",
    "app_domain",
    "app_category",
    "device_id",
    "device_ip",
    "device_model",
)
AVAZU_CATEGORICAL = (
    "C1",
    "banner_pos",
    *AVAZU_HEX,
    "device_type",
    "device_conn_type",
    *(f"C{k}" for k in range(14, 22)),
)
#: the columns of Avazu's header line (``id`` is not read; other columns are ignored)
AVAZU_COLUMNS = ("id", "click", "hour", *AVAZU_CATEGORICAL)
AVAZU_FEATURES = [*AVAZU_CATEGORICAL, "hour_of_day"]

#: Criteo integer features are 64-bit integers (``log1p`` of a larger one overflows or is not a count)
CRITEO_INT_MIN, CRITEO_INT_MAX = -(2**63), 2**63 - 1
#: timestamps (seconds since 1970) are within about 34,800 years of 1970
TIMESTAMP_LIMIT = 2**40


def _quote(s: str) -> str:
    """``repr(s)``, cut short for a long value (the message stays one short line)."""
    return repr(s) if len(s) <= 40 else f"{s[:20]!r}... ({len(s)} characters)"


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _bad_timestamp(s: str) -> str:
    return f"timestamp must be in seconds since 1970, within +-2**40 (about 34,800 years) but got {_quote(s)}"


def _no_header(row: Row, what: str) -> None:
    raise row.fail(
        f"the first line starts with {_quote(row.fields[0])}, a header line, but {what} files have none: remove it"
    )


def _sizes(num_embeddings: Sequence[int] | Dict[str, int], names: Sequence[str]) -> List[int]:
    if isinstance(num_embeddings, dict):
        unknown = sorted(set(num_embeddings) - set(names))
        if unknown:
            raise ConfigError(
                f"Unknown feature name(s) {unknown} in num_embeddings; valid names are {list(names)}"
            )
        missing = [n for n in names if n not in num_embeddings]
        if missing:
            raise ConfigError(f"num_embeddings has no size for feature(s) {missing}")
        given = [num_embeddings[n] for n in names]
    else:
        given = list(num_embeddings)
        if len(given) != len(names):
            raise ConfigError(
                f"Expected {len(names)} table sizes (one per feature {list(names)}) but got {len(given)}"
            )
    for name, n in zip(names, given):
        if not is_int(n) or n < 1:
            raise ConfigError(f"Table size for feature '{name}' must be a positive integer but got {n!r}")
    return [int(n) for n in given]


def _kjt(names: Sequence[str], per_feature: List[List[List[int]]]) -> KeyedJaggedTensor:
    values: List[int] = []
    lengths: List[int] = []
    for bags in per_feature:
        for bag in bags:
            values.extend(bag)
            lengths.append(len(bag))
    return KeyedJaggedTensor(
        keys=list(names),
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int32),
    )


class CriteoTSVParser(LineFormat):
    """Criteo TSV rows: ``label``, 13 integer features (may be empty or negative), 26 hex categoricals; no
    header line.

    Integers are clamped at 0 and log-transformed (``log1p``, DLRM's preprocessing); empty integers are 0; one
    outside the 64-bit range is refused.
    Categoricals are parsed as hexadecimal and hashed into each table (``value % rows``); an empty categorical
    is id 0.

    Args:
        num_embeddings: rows per table, a list of 26 or a mapping feature name -> rows.
        feature_names: sparse feature names (TorchRec's ``cat_0`` .. ``cat_25``).
    """

    num_fields = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT

    def __init__(
        self, num_embeddings: Sequence[int] | Dict[str, int], feature_names: Sequence[str] = DEFAULT_CAT_NAMES
    ) -> None:
        self.feature_names = list(feature_names)
        self.sizes = _sizes(num_embeddings, self.feature_names)

    def wrong_field_count(self, n: int, header: Optional[Header] = None) -> str:
        return (
            f"expected {self.num_fields} tab-separated fields (label, 13 integer, 26 categorical) but got {n}; is "
            "this the Criteo TSV format?"
        )

    def first_line(self, row: Row) -> Optional[Header]:
        if len(row.fields) > 1 and not _is_number(row.fields[0]):
            _no_header(row, "Criteo TSV")
        return None

    def __call__(self, rows: List[Row]) -> Batch:
        labels: List[float] = []
        dense: List[List[float]] = []
        cats: List[List[List[int]]] = [[] for _ in self.feature_names]
        for row in rows:
            f = row.fields
            if len(f) != self.num_fields:
                raise row.fail(self.wrong_field_count(len(f)))
            if f[0] not in ("0", "1"):
                raise row.fail(f"label must be 0 or 1 but got {f[0]!r}")
            labels.append(float(f[0]))
            d: List[float] = []
            for k in range(INT_FEATURE_COUNT):
                s = f[1 + k]
                try:
                    v = int(s) if s else 0
                except ValueError:
                    raise row.fail(f"integer feature I{k + 1} is not an integer: {_quote(s)}") from None
                if not CRITEO_INT_MIN <= v <= CRITEO_INT_MAX:
                    raise row.fail(
                        f"integer feature I{k + 1} must be a 64-bit integer (-2**63 .. 2**63-1) but got {_quote(s)}"
                    )
                d.append(math.log1p(max(v, 0)))
            dense.append(d)
            for k, n in enumerate(self.sizes):
                s = f[1 + INT_FEATURE_COUNT + k]
                try:
                    v = int(s, 16) if s else 0
                except ValueError:
                    raise row.fail(f"categorical feature C{k + 1} is not hexadecimal: {s!r}") from None
                cats[k].append([v % n])
        return Batch(
            dense_features=torch.tensor(dense, dtype=torch.float32),
            sparse_features=_kjt(self.feature_names, cats),
            labels=torch.tensor(labels, dtype=torch.float32),
        )


class MovieLensParser(LineFormat):
    """MovieLens ``ratings.csv`` rows (``userId,movieId,rating,timestamp``): features user, movie and the
    movie's genres (multi-hot, from ``movies.csv`` when given); label ``rating >= 4``; one dense feature, the
    rating time scaled to years since 1995.

    Each file starts with MovieLens's header line, which names the columns (in any order; others are ignored).
    A rating is a number in [0, 5]; a timestamp is within +-2**40 seconds of 1970.

    Args:
        num_embeddings: rows per table for ``user``, ``movie``, ``genres`` (ids are taken modulo the size).
        genres: movie id -> genre ids (empty when ``movies.csv`` is not given: every movie has genre 0); when
            given, a rating of a movie it lacks is refused (:class:`~torchrec_lookahead.errors.DataError`).
        movies_file: the file ``genres`` was read from, named in that error.
    """

    def __init__(
        self,
        num_embeddings: Sequence[int] | Dict[str, int],
        genres: Optional[Dict[int, List[int]]] = None,
        movies_file: Optional[str] = None,
    ):
        self.sizes = _sizes(num_embeddings, MOVIELENS_FEATURES)
        self.genres = genres or {}
        self.movies_file = movies_file

    num_fields = 4

    def wrong_field_count(self, n: int, header: Optional[Header] = None) -> str:
        if header is not None:
            return f"expected {header.width} comma-separated fields (as in the header line) but got {n}"
        return f"expected 4 comma-separated fields (userId,movieId,rating,timestamp) but got {n}"

    def first_line(self, row: Row) -> Optional[Header]:
        return _header(row, MOVIELENS_COLUMNS, "ratings")

    def __call__(self, rows: List[Row]) -> Batch:
        users: List[List[int]] = []
        movies: List[List[int]] = []
        genres: List[List[int]] = []
        dense: List[List[float]] = []
        labels: List[float] = []
        nu, nm, ng = self.sizes
        for row in rows:
            f = row.fields
            if len(f) != 4:
                raise row.fail(self.wrong_field_count(len(f)))
            try:
                u, m, r, ts = int(f[0]), int(f[1]), float(f[2]), int(f[3])
            except ValueError:
                raise row.fail(f"cannot parse {f!r} as userId,movieId,rating,timestamp") from None
            if u < 0 or m < 0:
                raise row.fail(f"negative id in {f!r}")
            if not 0.0 <= r <= 5.0:
                raise row.fail(
                    f"rating must be a number in [0, 5] (MovieLens's are 0.5 .. 5.0) but got {_quote(f[2])}"
                )
            if not -TIMESTAMP_LIMIT < ts < TIMESTAMP_LIMIT:
                raise row.fail(_bad_timestamp(f[3]))
            movie_genres = self.genres.get(m) if self.genres else [0]
            if movie_genres is None:
                raise row.fail(self._missing_movie(m))
            users.append([u % nu])
            movies.append([m % nm])
            genres.append([g % ng for g in movie_genres])
            dense.append([(ts - 788_918_400) / 31_557_600.0])
            labels.append(1.0 if r >= 4.0 else 0.0)
        return Batch(
            dense_features=torch.tensor(dense, dtype=torch.float32),
            sparse_features=_kjt(MOVIELENS_FEATURES, [users, movies, genres]),
            labels=torch.tensor(labels, dtype=torch.float32),
        )

    def _missing_movie(self, movie: int) -> str:
        source = f"the movies file {self.movies_file}" if self.movies_file else "the genres given"
        return (
            f"movieId {movie} is not in {source}; give the movies.csv of the same MovieLens release as the "
            "ratings, or no movies_file (every movie then has genre 0)"
        )


def _header(row: Row, names: Sequence[str], what: str, source: str = "MovieLens") -> Header:
    """The columns of ``names`` in a ``source`` (MovieLens, Avazu) file's header line ``row`` (any order, other
    columns ignored).

    Raises:
        DataError: the line is not such a header line.
    """
    have = [c.strip() for c in row.fields]
    missing = [n for n in names if n not in have]
    if missing:
        line = _quote(",".join(row.fields))
        got = (
            f"lacks the column(s) {', '.join(missing)}"
            if len(missing) < len(names)
            else f"{line} is not {source}'s header line"
        )
        tabs = f" (it holds tabs: {source} files are comma-separated)" if "\t" in row.fields[0] else ""
        article = "an" if source[0] in "AEIOU" else "a"
        raise row.fail(
            f"the first line {got}{tabs}; {article} {source} {what} file starts with the header line "
            f"{','.join(names)} (columns in any order): add it"
        )
    return Header([have.index(n) for n in names], len(have))


def read_movielens_genres(path: str) -> Dict[int, List[int]]:
    """Map movie id -> genre ids from MovieLens ``movies.csv`` (genre ids in order of first appearance, from 1).

    The file starts with its header line ``movieId,title,genres`` (columns in any order, others ignored).

    Raises:
        DataError: the file is missing, has no header line or no movies, or a line is malformed.
    """
    import csv

    from torchrec_lookahead.data.text import check_files, utf8_lines

    (path,) = check_files([path])
    vocab: Dict[str, int] = {}
    out: Dict[int, List[int]] = {}
    lines = utf8_lines(path)
    try:
        reader = csv.reader(lines)
        first = next(reader, None)
        if first is None:
            raise DataError(
                f"{path}: the movies file is empty; give MovieLens's movies.csv (movieId,title,genres)"
            )
        header = _header(Row(first, path, 1), MOVIES_COLUMNS, "movies")
        id_col, genres_col = header.columns[0], header.columns[2]
        what = "(movieId,title,genres)" if header.identity else "(as in the header line)"
        for i, rec in enumerate(reader, start=2):
            if len(rec) != header.width:
                raise Row(rec, path, i).fail(f"expected {header.width} fields {what} but got {len(rec)}")
            try:
                movie = int(rec[id_col])
            except ValueError:
                raise Row(rec, path, i).fail(f"movieId is not an integer: {rec[id_col]!r}") from None
            out[movie] = [vocab.setdefault(g, len(vocab) + 1) for g in rec[genres_col].split("|")]
    finally:
        lines.close()  # the file, also when a line is refused
    if not out:
        raise DataError(
            f"{path}: the movies file holds no movies (only its header line); give MovieLens's movies.csv"
        )
    return out


class TaobaoParser(LineFormat):
    """Taobao UserBehavior rows (``user_id,item_id,category_id,behavior,timestamp``, no header line): features
    user, item, category; label 1 for buy, cart or fav, 0 for pv; one dense feature, the hour of day in [0, 1).
    A timestamp is within +-2**40 seconds of 1970.

    Args:
        num_embeddings: rows per table for ``user``, ``item``, ``category`` (ids are taken modulo the size).
    """

    def __init__(self, num_embeddings: Sequence[int] | Dict[str, int]):
        self.sizes = _sizes(num_embeddings, TAOBAO_FEATURES)

    num_fields = 5

    def wrong_field_count(self, n: int, header: Optional[Header] = None) -> str:
        return (
            f"expected 5 comma-separated fields (user_id,item_id,category_id,behavior,timestamp) but got {n}"
        )

    def first_line(self, row: Row) -> Optional[Header]:
        f = row.fields
        if len(f) > 1 and not _is_number(f[0]) and (len(f) < 4 or f[3] not in TAOBAO_BEHAVIOURS):
            _no_header(row, "Taobao UserBehavior")
        return None

    def __call__(self, rows: List[Row]) -> Batch:
        cols: List[List[List[int]]] = [[], [], []]
        dense: List[List[float]] = []
        labels: List[float] = []
        for row in rows:
            f = row.fields
            if len(f) != 5:
                raise row.fail(self.wrong_field_count(len(f)))
            if f[3] not in TAOBAO_BEHAVIOURS:
                raise row.fail(f"behavior must be one of {list(TAOBAO_BEHAVIOURS)} but got {f[3]!r}")
            try:
                ids = [int(f[0]), int(f[1]), int(f[2])]
                ts = int(f[4])
            except ValueError:
                raise row.fail(f"cannot parse ids/timestamp in {f!r}") from None
            if min(ids) < 0:
                raise row.fail(f"negative id in {f!r}")
            if not -TIMESTAMP_LIMIT < ts < TIMESTAMP_LIMIT:
                raise row.fail(_bad_timestamp(f[4]))
            for k, (v, n) in enumerate(zip(ids, self.sizes)):
                cols[k].append([v % n])
            dense.append([((ts + 8 * 3600) % 86400) / 86400.0])
            labels.append(1.0 if f[3] in TAOBAO_POSITIVE else 0.0)
        return Batch(
            dense_features=torch.tensor(dense, dtype=torch.float32),
            sparse_features=_kjt(TAOBAO_FEATURES, cols),
            labels=torch.tensor(labels, dtype=torch.float32),
        )


class AvazuParser(LineFormat):
    """Avazu CTR rows (Kaggle ``train.csv``: ``id,click,hour,C1,banner_pos,site_id,...,C21``): the 21 categorical
    columns and ``hour_of_day`` (the last two digits of ``hour``, ``YYMMDDHH``) as sparse features; label
    ``click``; one dense feature, the day of week in [0, 1) (Monday 0).

    Each file starts with Avazu's header line, which names the columns (in any order; others are ignored; ``id``
    is not read). The hashed ids (``site_id`` .. ``app_category``, ``device_id``, ``device_ip``, ``device_model``) are
    parsed as hexadecimal, the other categoricals as integers, and hashed into each table (``value % rows``, as
    Criteo's).

    Args:
        num_embeddings: rows per table, a list of 22 (in :data:`AVAZU_FEATURES` order) or a mapping feature name
            -> rows.

    Example:
        >>> parse = AvazuParser([100] * 22)
        >>> header = "id,click,hour," + ",".join(AVAZU_CATEGORICAL)
        >>> parse.first_line(Row(header.split(","), "a.csv", 1)).identity
        True
        >>> fields = ["7", "1", "14102117", "1005", "0"] + ["1fbe01fe"] * 9 + ["1", "2"] + ["320"] * 8
        >>> b = parse([Row(fields, "a.csv", 2)])
        >>> b.labels.tolist(), b.sparse_features["hour_of_day"].values().tolist(), b.dense_features.tolist()
        ([1.0], [17], [[0.1428571492433548]])
    """

    num_fields = len(AVAZU_COLUMNS)

    def __init__(self, num_embeddings: Sequence[int] | Dict[str, int]):
        self.sizes = _sizes(num_embeddings, AVAZU_FEATURES)

    def wrong_field_count(self, n: int, header: Optional[Header] = None) -> str:
        width = header.width if header is not None else self.num_fields
        return f"expected {width} comma-separated fields (as in the header line) but got {n}"

    def first_line(self, row: Row) -> Optional[Header]:
        return _header(row, AVAZU_COLUMNS, "train", "Avazu")

    def __call__(self, rows: List[Row]) -> Batch:
        cats: List[List[List[int]]] = [[] for _ in AVAZU_FEATURES]
        dense: List[List[float]] = []
        labels: List[float] = []
        for row in rows:
            f = row.fields
            if len(f) != self.num_fields:
                raise row.fail(self.wrong_field_count(len(f)))
            if f[1] not in ("0", "1"):
                raise row.fail(f"click must be 0 or 1 but got {_quote(f[1])}")
            h = f[2]
            try:
                if len(h) != 8 or not (h.isascii() and h.isdigit()):
                    raise ValueError(h)
                day = datetime.date(2000 + int(h[:2]), int(h[2:4]), int(h[4:6]))
                hour = int(h[6:])
                if hour > 23:
                    raise ValueError(h)
            except ValueError:
                raise row.fail(f"hour must be YYMMDDHH (as 14102100) but got {_quote(h)}") from None
            for k, (name, s) in enumerate(zip(AVAZU_CATEGORICAL, f[3:])):
                hexadecimal = name in AVAZU_HEX
                try:
                    v = int(s, 16 if hexadecimal else 10)
                except ValueError:
                    kind = "hexadecimal" if hexadecimal else "an integer"
                    raise row.fail(f"categorical feature {name} is not {kind}: {_quote(s)}") from None
                cats[k].append([v % self.sizes[k]])
            cats[-1].append([hour % self.sizes[-1]])
            dense.append([day.weekday() / 7.0])
            labels.append(float(f[1]))
        return Batch(
            dense_features=torch.tensor(dense, dtype=torch.float32),
            sparse_features=_kjt(AVAZU_FEATURES, cats),
            labels=torch.tensor(labels, dtype=torch.float32),
        )
