"""MovieLens rating histories in time order: each rating with the movies its user rated before it.

The ratings of every file are read once, sorted by time (ties keep file order) and each row is given the
user's previous ``history_length`` movies, oldest first. The rows then flow through
:class:`~torchrec_lookahead.data.text.LineBatchDataset` like any file's (rank split, drop_last, exact resume),
so the history is complete whichever rank reads a row. Features: MovieLens' ``user``, ``movie``, ``genres`` and
``history`` (a sequence of movie ids, for an ``EmbeddingCollection`` sharing the movie table)::

    user  movie  genres      history
    [7]   [31]   [1, 4]      [1029, 1061, 1129]     <- user 7's three earlier ratings, oldest first

Example:
    >>> from torchrec_lookahead.data.text import Row
    >>> parse = MovieLensHistoryParser([10, 100, 4])
    >>> b = parse([Row(["7", "31", "4.5", "1260759144", "12 13"], "ratings.csv", 2)])
    >>> b.sparse_features.keys(), b.sparse_features["history"].values().tolist(), b.labels.tolist()
    (['user', 'movie', 'genres', 'history'], [12, 13], [1.0])
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead._checks import check_int
from torchrec_lookahead.data.datamodules import MovieLensDataModule
from torchrec_lookahead.data.readers import MOVIELENS_FEATURES, MovieLensParser, _kjt
from torchrec_lookahead.data.text import Header, LineBatchDataset, LineFormat, Row

__all__ = ["MovieLensHistoryDataModule", "MovieLensHistoryParser", "HISTORY_FEATURE"]

HISTORY_FEATURE = "history"


class MovieLensHistoryParser(LineFormat):
    """MovieLens rows with a fifth field, the space-separated movie ids rated before (see the module doc).

    Args:
        num_embeddings: rows per table for ``user``, ``movie``, ``genres``; history ids share the movie table's
            size (ids are taken modulo it).
        genres: movie id -> genre ids.
        movies_file: the file ``genres`` was read from (see :class:`MovieLensParser`).
    """

    def __init__(
        self,
        num_embeddings: Union[Sequence[int], Dict[str, int]],
        genres: Optional[Dict[int, List[int]]] = None,
        movies_file: Optional[str] = None,
    ):
        self.ratings = MovieLensParser(num_embeddings, genres, movies_file)
        self.sizes = self.ratings.sizes

    num_fields = 5  # the rows it is given: the file's four and the history

    def wrong_field_count(self, n: int, header: Optional[Header] = None) -> str:
        return f"expected userId,movieId,rating,timestamp,history but got {n} fields"

    def first_line(self, row: Row) -> Optional[Header]:
        return self.ratings.first_line(row)

    def __call__(self, rows: List[Row]) -> Batch:
        histories: List[List[int]] = []
        for row in rows:
            if len(row.fields) != 5:
                raise row.fail(self.wrong_field_count(len(row.fields)))
            try:
                histories.append([int(m) % self.sizes[1] for m in row.fields[4].split()])
            except ValueError:
                raise row.fail(f"history {row.fields[4]!r} is not a list of movie ids") from None
        batch = self.ratings([Row(r.fields[:4], r.path, r.line) for r in rows])
        sparse = KeyedJaggedTensor.concat([batch.sparse_features, _kjt([HISTORY_FEATURE], [histories])])
        return Batch(dense_features=batch.dense_features, sparse_features=sparse, labels=batch.labels)


class _HistoryLines(LineBatchDataset):
    """The files' rows sorted by time, each with its user's earlier movies (computed once, kept in memory)."""

    def __init__(self, *args: object, history_length: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.history_length = history_length
        self._sorted: Optional[List[Tuple[str, int, str]]] = None

    def _lines(self) -> Iterator[Tuple[str, int, str]]:
        if self._sorted is None:
            rows = []
            ratings = MovieLensParser([1, 1, 1])  # its messages
            for path, i, line in super()._lines():
                f = line.split(self.delimiter)
                if len(f) != 4:
                    raise Row(f, path, i).fail(ratings.wrong_field_count(len(f)))
                try:
                    rows.append((int(f[3]), int(f[0]), f[1], path, i, line))
                except ValueError:
                    raise Row(f, path, i).fail(f"cannot parse userId/timestamp in {f!r}") from None
            rows.sort(key=lambda r: r[0])  # stable: equal times keep file order
            seen: Dict[int, List[str]] = {}
            out = []
            for _, user, movie, path, i, line in rows:
                past = seen.setdefault(user, [])
                history = past[-self.history_length :] if self.history_length else []
                out.append((path, i, f"{line}{self.delimiter}{' '.join(history)}"))
                past.append(movie)
            self._sorted = out
        yield from self._sorted


class MovieLensHistoryDataModule(MovieLensDataModule):
    """MovieLens ratings in time order, each with its user's rating history (see the module doc).

    Args:
        train_files: ``ratings.csv`` file(s) (with header).
        val_files: validation file(s) (their histories are their own files').
        test_files: test file(s).
        movies_file: ``movies.csv`` for genres (optional; a rated movie it lacks is a ``DataError``).
        num_embeddings: rows for ``user``, ``movie``, ``genres`` (``history`` shares the movie table).
        history_length: most recent earlier ratings kept per sample (0: empty histories).
        batch_size: rows per batch per rank.
        drop_last: drop a final partial batch (default: only with several ranks).

    Raises:
        ConfigError: a negative ``history_length``.
    """

    def __init__(
        self,
        train_files: Union[str, List[str]],
        val_files: Union[None, str, List[str]] = None,
        test_files: Union[None, str, List[str]] = None,
        movies_file: Optional[str] = None,
        num_embeddings: Union[Sequence[int], Dict[str, int]] = (1024, 200_000, 32),
        history_length: int = 20,
        batch_size: int = 512,
        drop_last: Optional[bool] = None,
    ) -> None:
        check_int("history_length", history_length, 0, "give the earlier ratings kept per sample (0: none)")
        super().__init__(
            train_files, val_files, test_files, movies_file, num_embeddings, batch_size, drop_last
        )
        self.history_length = history_length
        self._history_parse = MovieLensHistoryParser(
            self._parse.sizes, self._parse.genres, self._parse.movies_file
        )

    def _parser(self) -> MovieLensHistoryParser:
        return self._history_parse

    def _dataset(self, *args: object, **kwargs: object) -> LineBatchDataset:
        return _HistoryLines(*args, history_length=self.history_length, **kwargs)

    @property
    def num_embeddings_per_feature(self) -> Dict[str, int]:
        sizes = dict(zip(MOVIELENS_FEATURES, self._parse.sizes))
        return {**sizes, HISTORY_FEATURE: sizes["movie"]}
