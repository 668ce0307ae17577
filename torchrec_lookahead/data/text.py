"""Streaming readers of delimited text files into TorchRec batches, in file order.

A :class:`LineBatchDataset` reads lines from one or more files, groups them into global batches of
``batch_size * world_size`` rows, keeps this rank's contiguous slice and hands the rows to a parser that
builds a :class:`~torchrec.datasets.utils.Batch`. Every malformed line is reported with its file and line
number.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
from dataclasses import dataclass
from typing import Callable, Generator, Iterator, List, Optional, Sequence, Tuple

from torch.utils.data import IterableDataset
from torchrec.datasets.utils import Batch

from torchrec_lookahead.errors import ConfigError, DataError

__all__ = ["Row", "Header", "LineFormat", "LineBatchDataset", "check_files", "utf8_lines"]


@dataclass(frozen=True)
class Row:
    """One data line with where it came from (for error messages)."""

    fields: List[str]
    path: str
    line: int

    def fail(self, what: str) -> DataError:
        """A :class:`DataError` naming this row's file and line."""
        return DataError(f"{self.path}:{self.line}: {what}")


@dataclass(frozen=True)
class Header:
    """A file's header line, read: where each of the parser's fields is in the file's lines."""

    columns: List[int]  #: the file's column of each field the parser takes, in the parser's order
    width: int  #: fields per line of the file (the header's)

    @property
    def identity(self) -> bool:
        """The file's lines hold the parser's fields as they are (no reordering needed)."""
        return self.width == len(self.columns) and self.columns == list(range(self.width))


class LineFormat:
    """Checks of a text format that :class:`LineBatchDataset` makes before its parser sees a row; a parser that
    derives from this class gets them (also in the pass that counts the rows, before training)."""

    #: fields per line; ``None``: not checked by the reader
    num_fields: Optional[int] = None

    def wrong_field_count(self, n: int, header: Optional[Header] = None) -> str:
        """The message for a line of ``n`` fields (``header``: the file's header line, when it has one)."""
        expected = header.width if header is not None else self.num_fields
        return f"expected {expected} fields but got {n}"

    def first_line(self, row: Row) -> Optional[Header]:
        """Look at each file's first line: ``None`` for a data line (read as one), a :class:`Header` for a header
        line (skipped; the file's later lines are taken in its column order).

        Raises:
            DataError: the first line is not what the format has there (a header where there is none, or none
                where one is needed).
        """
        return None


def check_files(paths: Sequence[str]) -> List[str]:
    """Return the paths as a list, raising :class:`DataError` for any that is missing or cannot be read.

    Raises:
        DataError: a path does not exist, is a directory, a pipe or other file that is not a regular one, a
            symbolic link loop, or cannot be read.
    """
    out = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    if not out:
        raise ConfigError("Expected at least one data file but got none")
    for p in out:
        try:
            mode = os.stat(p).st_mode
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise DataError(
                    f"Data file {p!r} is a loop of symbolic links (one leads back to another); point the link at "
                    "the data file"
                ) from None
            if e.errno not in (errno.ENOENT, errno.ENOTDIR):
                raise DataError(f"Data file {p!r} cannot be read: {e.strerror}; check the path") from None
            link = (
                f" (a symbolic link to {os.readlink(p)!r}, which does not exist)" if os.path.islink(p) else ""
            )
            raise DataError(
                f"Data file not found: {p!r}{link}; check the path (relative paths start at {os.getcwd()})"
            ) from None
        if stat.S_ISDIR(mode):
            raise DataError(f"Data file {p!r} is a directory; name the data files in it")
        if not stat.S_ISREG(mode):
            raise DataError(
                f"Data file {p!r} is not a regular file (a pipe such as <(zcat f.gz), or a device); the data is read "
                "twice (rows counted, then read): decompress or copy it to a file and name that"
            )
        if not os.access(p, os.R_OK):
            raise DataError(f"Data file {p!r} cannot be read: no permission; give this user read access")
    return out


def utf8_lines(path: str) -> Generator[str, None, None]:
    """The lines of the text file ``path``, line ends kept (split as ``open(..., newline="")`` splits them), each
    checked to be UTF-8 as it is read.

    A UTF-8 byte order mark at the start of the file is skipped.

    Raises:
        DataError: a line is not UTF-8 text (file, line and byte named); the file is gzip-compressed.
    """
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
        first = f.readline()
        lines = itertools.chain((first,), f) if first else f
        if first.startswith("\x1f\udc8b"):  # gzip's magic bytes 1f 8b
            raise DataError(
                f"{path}: the file is gzip-compressed; decompress it first (gunzip -k) and name that file"
            )
        if first.startswith("\ufeff"):
            lines = itertools.chain((first[1:],), f)
        for i, line in enumerate(lines, start=1):
            if not line.isascii():
                _check_utf8(path, i, line.rstrip("\r\n"))
            yield line


def _check_utf8(path: str, line: int, text: str) -> None:
    """Refuse a line read with ``errors="surrogateescape"`` that held bytes that are not UTF-8.

    Raises:
        DataError: naming the file, the line and the first such byte (its column in the line's bytes).
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        column = len(text[: e.start].encode("utf-8", "surrogateescape")) + 1
        byte = text[e.start].encode("utf-8", "surrogateescape")[0]
        raise DataError(
            f"{path}:{line}: not UTF-8 text (byte 0x{byte:02x} at byte {column} of the line); the file is damaged "
            "or in another encoding: convert it to UTF-8 or remove the line"
        ) from None


class LineBatchDataset(IterableDataset):
    """Batches of parsed lines from delimited text files, in file order.

    Args:
        paths: files read one after another.
        parse: builds a batch from rows (this rank's slice of a global batch).
        batch_size: rows per batch per rank.
        delimiter: field separator.
        skip_header: lines skipped at the top of each file.
        world_size: ranks sharing each global batch.
        rank: this rank.
        drop_last: drop a final partial global batch.
        num_rows: rows in all files if known (otherwise counted once).

    A ``parse`` that is a :class:`LineFormat` has its first-line and field-count checks made here, the field
    count also in the pass that counts the rows (before training).
    """

    #: each rank reads only its own part of every global batch (see ``rank`` / ``world_size``)
    splits_by_rank = True

    def __init__(
        self,
        paths: Sequence[str],
        parse: Callable[[List[Row]], Batch],
        batch_size: int,
        delimiter: str = ",",
        skip_header: int = 0,
        world_size: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        num_rows: Optional[int] = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"Expected batch_size to be a positive integer but got {batch_size}")
        self.paths = check_files(paths)
        self.parse = parse
        self.batch_size = batch_size
        self.delimiter = delimiter
        self.skip_header = skip_header
        self.world_size = world_size
        self.rank = rank
        self.drop_last = drop_last
        self.start_batch = 0
        self._num_rows = num_rows

    def source_identity(self) -> List[List[object]]:
        """What a resumed epoch must read again, file by file: its name and size in bytes (a mid-epoch
        checkpoint's position counts batches of these files; :class:`~torchrec_lookahead.data.ResumableBatchLoader`
        refuses to resume over other ones)."""
        return [[os.path.basename(p), os.stat(p).st_size] for p in self.paths]

    def _lines(self) -> Iterator[Tuple[str, int, str]]:
        """Every non-empty line after the headers, with its file and line number; in a file whose header line
        orders the columns otherwise, the line rebuilt with the parser's fields in the parser's order.

        Raises:
            DataError: a line is not UTF-8 text (its bytes are read as lone surrogates, found per line); the
                format refuses a file's first line; a line's field count differs from its file's header's.
        """
        fmt = self.parse if isinstance(self.parse, LineFormat) else None
        d = self.delimiter
        first = self.skip_header + 1
        for path in self.paths:
            header: Optional[Header] = None
            for i, line in enumerate(utf8_lines(path), start=1):
                if i < first:
                    continue
                line = line.rstrip("\r\n")
                if i == first and fmt is not None:
                    header = fmt.first_line(Row(line.split(d), path, i))
                    if header is not None:
                        header = None if header.identity else header
                        continue
                if header is not None and fmt is not None and line:
                    f = line.split(d)
                    if len(f) != header.width:
                        raise Row(f, path, i).fail(fmt.wrong_field_count(len(f), header))
                    line = d.join([f[c] for c in header.columns])
                if line:
                    yield path, i, line

    def num_rows(self) -> int:
        """Data rows in all files (counted once, then cached); a line with the wrong number of fields is refused
        here already when the parser is a :class:`LineFormat` that knows its fields.

        Raises:
            DataError: as :meth:`_lines`, and a line with another field count than the format's.
        """
        if self._num_rows is None:
            fmt = self.parse if isinstance(self.parse, LineFormat) else LineFormat()
            d = self.delimiter
            seps = -1 if fmt.num_fields is None else fmt.num_fields - 1
            n = 0
            for path, i, line in self._lines():
                n += 1
                if seps >= 0 and line.count(d) != seps:
                    f = line.split(d)
                    raise Row(f, path, i).fail(fmt.wrong_field_count(len(f)))
            self._num_rows = n
        return self._num_rows

    def __len__(self) -> int:
        g = self.batch_size * self.world_size
        n = self.num_rows()
        return n // g if self.drop_last else -(-n // g)

    def _emit(self, rows: List[Row]) -> Optional[Batch]:
        per = -(-len(rows) // self.world_size)
        mine = rows[self.rank * per : (self.rank + 1) * per]
        return self.parse(mine) if mine else None

    def __iter__(self) -> Iterator[Batch]:
        g = self.batch_size * self.world_size
        skip_rows = self.start_batch * g
        rows: List[Row] = []
        for n, (path, i, line) in enumerate(self._lines()):
            if n < skip_rows:
                continue
            rows.append(Row(line.split(self.delimiter), path, i))
            if len(rows) == g:
                batch = self._emit(rows)
                rows = []
                if batch is not None:
                    yield batch
        if rows and not self.drop_last:
            batch = self._emit(rows)
            if batch is not None:
                yield batch
