"""LineBatchDataset: lines of delimited text files, each malformed one reported with its file and line."""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from torchrec_lookahead.data.text import LineBatchDataset, Row
from torchrec_lookahead.errors import DataError


def _fields(rows: List[Row]) -> List[List[str]]:
    return [r.fields for r in rows]


def test_a_line_that_is_not_utf8_is_a_data_error_naming_file_line_and_byte(tmp_path: Path) -> None:
    path = tmp_path / "a.tsv"
    path.write_bytes("1\tcafé\r\n0\tb\n".encode() + b"1\t\xff\xfe\x00x\n0\tc\n")
    data = LineBatchDataset([str(path)], _fields, batch_size=1, delimiter="\t")  # type: ignore[arg-type]
    with pytest.raises(DataError) as e:
        data.num_rows()  # counted before training: found there
    assert str(e.value) == (
        f"{path}:3: not UTF-8 text (byte 0xff at byte 3 of the line); the file is damaged or in another "
        "encoding: convert it to UTF-8 or remove the line"
    )
    with pytest.raises(DataError, match=rf"{path}:3: not UTF-8 text"):
        list(data)
    path.write_bytes("1\tcafé\r\n0\tb\n".encode())  # UTF-8 beyond ASCII, CRLF: read as before
    assert list(data) == [[["1", "café"]], [["0", "b"]]]


def test_a_gzip_file_a_bom_and_files_that_are_not_regular_are_named_for_what_they_are(tmp_path: Path) -> None:
    import gzip
    import os

    from torchrec_lookahead.data.text import check_files, utf8_lines

    gz = tmp_path / "a.tsv"
    gz.write_bytes(gzip.compress(b"1\ta\n0\tb\n"))
    with pytest.raises(DataError) as e:
        list(utf8_lines(str(gz)))
    assert (
        str(e.value)
        == f"{gz}: the file is gzip-compressed; decompress it first (gunzip -k) and name that file"
    )
    bom = tmp_path / "b.tsv"
    bom.write_bytes(b"\xef\xbb\xbf1\ta\r\n0\tb\n")
    assert list(utf8_lines(str(bom))) == ["1\ta\r\n", "0\tb\n"]
    data = LineBatchDataset([str(bom)], _fields, batch_size=2, delimiter="\t")  # type: ignore[arg-type]
    assert list(data) == [[["1", "a"], ["0", "b"]]]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(
        DataError, match=r"'.*fifo' is not a regular file \(a pipe such as <\(zcat f.gz\), or a "
    ):
        check_files([str(fifo)])
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    with pytest.raises(DataError, match=r"'.*loop_a' is a loop of symbolic links"):
        check_files([str(tmp_path / "loop_a")])
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(
        DataError, match=r"Data file not found: '.*dangling' \(a symbolic link to '.*gone', which"
    ):
        check_files([str(tmp_path / "dangling")])
