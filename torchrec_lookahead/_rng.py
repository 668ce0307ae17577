"""Random streams the library leaves as it found them.

Exactness covers models that draw random numbers in their forward pass (dropout): a cached fit must see the
global random streams of the resident fit at every step. The library therefore never draws from them on a
thread of its own, and runs the set-up work that does draw (TorchRec's initialisation of sharded tables, the
capacity pre-scan's pass over the data) inside :class:`preserved_rng`, which puts every stream back on exit.

Example:
    >>> import torch
    >>> before = torch.get_rng_state()
    >>> with preserved_rng():
    ...     _ = torch.rand(3)
    >>> torch.equal(before, torch.get_rng_state())
    True
"""

from __future__ import annotations

import random
from typing import Any, List

import numpy as np
import torch

__all__ = ["preserved_rng"]


class preserved_rng:
    """Context manager restoring, on exit, torch's (CPU and every initialised CUDA device), numpy's and Python's
    global random states and those of the ``torch.Generator`` s of the given loaders (``loader.generator``, its
    sampler's, its batch sampler's sampler's), so that work inside it draws nothing from the streams the model
    sees, and reading a loader once (a shuffling ``DataLoader`` draws its order from its generator or from
    torch's) leaves the order of its next iteration as it would have been.

    Not thread-safe by nature: it must run on the thread that trains (another thread drawing meanwhile would
    see its draws undone). The library's own threads never draw from the global streams.

    Args:
        loaders: loaders whose own generators to restore too.
    """

    def __init__(self, *loaders: Any) -> None:
        self._generators: List[torch.Generator] = []
        for loader in loaders:
            for path in (("generator",), ("sampler", "generator"), ("batch_sampler", "sampler", "generator")):
                obj: Any = loader
                for attr in path:
                    obj = getattr(obj, attr, None)
                if isinstance(obj, torch.Generator) and all(obj is not g for g in self._generators):
                    self._generators.append(obj)

    def __enter__(self) -> preserved_rng:
        self._torch = torch.get_rng_state()
        # CUDA devices initialise lazily; one initialised inside the block starts from its seed either way.
        self._cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._numpy = np.random.get_state()
        self._python = random.getstate()
        self._states = [g.get_state() for g in self._generators]
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.set_rng_state(self._torch)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)
        np.random.set_state(self._numpy)
        random.setstate(self._python)
        for g, state in zip(self._generators, self._states):
            g.set_state(state)
