import os
from pathlib import Path

import numpy as np
import pytest

from torchrec_lookahead._checks import (
    check_bytes,
    check_dir,
    check_int,
    check_number,
    check_output_file,
    is_int,
)
from torchrec_lookahead.errors import ConfigError


def test_integers_are_python_and_numpy_integers_but_not_bools():
    assert is_int(3) and is_int(np.int32(3)) and is_int(np.int64(-1))
    assert not any(is_int(v) for v in (True, False, 3.0, "3", None))


def test_check_int_returns_an_int_and_refuses_bools_and_small_values():
    value = check_int("ways", np.int64(4), 1, "set the associativity")
    assert value == 4 and type(value) is int
    with pytest.raises(
        ConfigError, match=r"ways must be an integer >= 1 but got True; set the associativity"
    ):
        check_int("ways", True, 1, "set the associativity")
    with pytest.raises(ConfigError, match=r"got 0"):
        check_int("ways", 0, 1, "set the associativity")


def test_check_number_and_check_bytes_refuse_strings_bools_and_small_values():
    assert check_number("scale", 1, 0.0, "fix") == 1.0
    for bad in ("big", True, float("nan"), -1.0):
        with pytest.raises(ConfigError, match=r"scale must be a number >= 0.0 but got .*; fix"):
            check_number("scale", bad, 0.0, "fix")
    assert check_bytes("host_budget_bytes", np.int64(8), "fix") == 8
    assert check_bytes("host_budget_bytes", {"t": 8}, "fix") == {"t": 8}
    with pytest.raises(
        ConfigError, match=r"host_budget_bytes must be positive: an integer, or a mapping .* 'lots'"
    ):
        check_bytes("host_budget_bytes", "lots", "fix")
    with pytest.raises(ConfigError, match=r"host_budget_bytes\['t'\] must be an integer >= 1 but got '8'"):
        check_bytes("host_budget_bytes", {"t": "8"}, "fix")


def test_check_dir_takes_a_directory_to_make_and_refuses_every_other_kind(tmp_path):
    assert check_dir("store_dir", str(tmp_path / "a" / "b")) == str(tmp_path / "a" / "b")
    assert not (tmp_path / "a").exists()  # makes nothing
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(ConfigError, match=r"store_dir '.*file' is a file, not a directory; name a directory"):
        check_dir("store_dir", str(file))
    with pytest.raises(ConfigError, match=r"cannot be made: '.*file' is a file, not a directory"):
        check_dir("store_dir", str(file / "sub"))
    with pytest.raises(ConfigError, match=r"store_dir must be a directory's path but got 3"):
        check_dir("store_dir", 3)


def _read_only(monkeypatch, root: Path) -> None:
    """Make ``root`` look like a read-only filesystem to the checks (as root, chmod would not stop a write)."""
    statvfs = os.statvfs

    class _Flags:
        def __init__(self, real: os.statvfs_result, read_only: bool) -> None:
            self.f_flag = real.f_flag | (os.ST_RDONLY if read_only else 0)

    monkeypatch.setattr(os, "statvfs", lambda p: _Flags(statvfs(p), str(p).startswith(str(root))))


def test_check_dir_and_check_output_file_refuse_a_read_only_filesystem_or_no_permission(
    tmp_path, monkeypatch
):
    _read_only(monkeypatch, tmp_path)
    with pytest.raises(
        ConfigError, match=r"store_dir '.*' is on a read-only filesystem .*; name a path on a writable"
    ):
        check_dir("store_dir", str(tmp_path / "stores"))
    with pytest.raises(ConfigError, match=r"hot_set '.*hot.pt' is on a read-only filesystem"):
        check_output_file("hot_set", str(tmp_path / "hot.pt"))
    monkeypatch.undo()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else access(p, mode))
    with pytest.raises(
        ConfigError, match=r"no permission to create files in '.*'; name a path this user can write"
    ):
        check_dir("store_dir", str(tmp_path))
