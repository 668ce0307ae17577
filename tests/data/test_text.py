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
