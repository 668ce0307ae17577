import numpy as np
import pytest

from torchrec_lookahead._checks import check_int, is_int
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
