"""Fixtures of the cache tests: a 1-rank gloo process group for the resident TorchRec baseline."""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch.distributed as dist

from ..conftest import free_port


@pytest.fixture(scope="module")
def gloo_pg() -> Iterator[None]:
    """Initialise a 1-rank gloo group for the test module (reusing one that already exists)."""
    created = False
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
        created = True
    yield
    if created and dist.is_initialized():
        dist.destroy_process_group()
