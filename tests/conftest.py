"""Shared fixtures: tiny models and data, the real-data folder, a free port."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Dict

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("TORCHREC_LOOKAHEAD_DATA", REPO.parent / "shared" / "data"))


def shared_data(*parts: str) -> Path:
    """A path under ../shared/data, skipping the test with a reason when it is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"real data sample {path} is absent (expected ../shared/data beside the repository)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TINY_TABLES = [
    50,
    20,
    300,
    100,
    7,
    3,
    40,
    30,
    2,
    60,
    25,
    200,
    15,
    5,
    35,
    150,
    4,
    22,
    18,
    3,
    120,
    6,
    5,
    45,
    9,
    55,
]


def tiny_data_args(**overrides: Any) -> Dict[str, Any]:
    args: Dict[str, Any] = dict(
        batch_size=64,
        num_train_batches=12,
        num_val_batches=3,
        num_test_batches=2,
        num_embeddings=list(TINY_TABLES),
        seed=0,
    )
    args.update(overrides)
    return args


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
