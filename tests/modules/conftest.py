"""Fixtures of the cache tests: a 1-rank gloo process group for the resident TorchRec baseline."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch.distributed as dist

from ..conftest import free_port


@pytest.fixture(scope="module")
def gloo_pg() -> Iterator[None]:
    """Initialise a 1-rank gloo group for the test module (reusing one that already exists)."""
    created = False
    if not dist.is_initialized():
        # init_method instead of MASTER_* variables, which subprocesses of later tests would inherit
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        created = True
    yield
    if created and dist.is_initialized():
        dist.destroy_process_group()
