"""Averaging the groups' dense replicas: EASGD with a center variable, or the plain periodic mean.

Each rank averages its own part of its group's replica (its shards of split layers, and its ``1/g`` chunk of
the replicated layers, which the group all-gathers afterwards) with the ranks holding the same part in the
other groups, over a process group of its own (one per in-group index). With ``p`` groups, replica ``x_k`` and
center ``c`` (a copy on every rank, identical across groups), a round at a step boundary is::

    easgd:  x_k <- x_k - alpha * (x_k - c)          c <- c + alpha * (mean_k x_k - c)
    mean:   x_k <- mean_k x_k

both from the values at the round's start. Zhang et al.'s center moves by ``alpha`` times the sum of the
differences (``beta = p * alpha``, stable for ``alpha <= 1/p``); here by ``alpha`` times their mean, so ``alpha``
in (0, 1] is stable for any ``p``. A round leaves ``sum_k x_k + p * c`` unchanged: the center, which receives no
gradient, weighs as much as all the replicas, and while the model moves steadily (``v`` per step) replicas and
center settle to a common speed of ``v / 2`` whatever ``alpha`` and ``sync_every`` are: half the dense learning
rate until the gradients are mostly noise. The mean leaves the replicas' mean where their steps put it.

``background=True`` (ShadowSync): the round's all-reduce runs on a snapshot while training goes on; every
rank launches it at the same step and waits for it at the next round (or before a checkpoint, or at the end),
never on ``work.is_completed()``, which differs between ranks and desynchronises them. The result is applied
as a difference, so the local steps taken meanwhile are kept::

    easgd:  x_k <- x_k - alpha * (s_k - c)          c <- c + alpha * (mean_k s_k - c)
    mean:   x_k <- x_k + (mean_k s_k - s_k)

with ``s_k`` the snapshot. :meth:`ReplicaAverager.average_now` is a blocking round to the mean for every group
(the end of a fit). The dense optimizer state (Adagrad sums, Adam moments) is not averaged: each
group keeps its own, as each HT trainer does; only the parameters move.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["Averaging", "ReplicaAverager", "round_update"]


class Averaging(str, enum.Enum):
    """How the groups' dense replicas are combined."""

    EASGD = "easgd"
    MEAN = "mean"


def _cat(tensors: Sequence[torch.Tensor], size: Optional[int] = None) -> torch.Tensor:
    """The tensors flattened into one fp32 copy, zero-padded to ``size``."""
    flat = [t.detach().reshape(-1).float() for t in tensors]
    n = sum(t.numel() for t in flat)
    if size is not None and size > n:
        flat.append(torch.zeros(size - n))
    return torch.cat(flat) if flat else torch.zeros(0)


def round_update(
    snapshot: torch.Tensor,
    mean: torch.Tensor,
    center: Optional[torch.Tensor],
    method: Averaging,
    alpha: float,
) -> torch.Tensor:
    """One round: the change to add to the replica (from its ``snapshot`` and the groups' ``mean``); moves
    ``center`` in place (EASGD). Consumes ``snapshot`` and ``mean``.

    Example:
        >>> c = torch.tensor([0.0])
        >>> round_update(torch.tensor([2.0]), torch.tensor([1.0]), c, Averaging.EASGD, 0.5), c
        (tensor([-1.]), tensor([0.5000]))
        >>> round_update(torch.tensor([2.0]), torch.tensor([1.0]), None, Averaging.MEAN, 0.5)
        tensor([-1.])
    """
    if method is Averaging.MEAN:
        return mean.sub_(snapshot)
    assert center is not None
    step = snapshot.sub_(center).mul_(-alpha)
    center.add_(mean.sub_(center).mul_(alpha))
    return step


class ReplicaAverager:
    """Periodic averaging of one rank's part of its group's dense replica across groups.

    Args:
        params: this rank's own dense tensors (its local shards of split layers).
        group: the process group of the ranks holding the same part in every group (``None``: one group).
        num_groups: the number of groups ``p``.
        method: ``easgd`` or ``mean``.
        elastic_alpha: EASGD's moving rate.
        sync_every: steps between rounds.
        background: run each round's all-reduce on a snapshot, applied at the next round.
        shared: tensors every rank of the group holds alike (replicated layers). Their rounds are shared out:
            rank ``i`` of the group averages the ``i``-th of ``g`` equal chunks, and the group all-gathers the
            result, so each replicated byte crosses groups once, not ``g`` times.
        in_group: the group's process group (needed with ``shared`` and more than one rank per group).

    With one group (``group=None``) there is no other replica: steps are counted, nothing moves.

    Example:
        >>> w = torch.ones(3)
        >>> avg = ReplicaAverager([w], None, 1, Averaging.EASGD, 0.5, sync_every=2)
        >>> avg.after_step(); avg.after_step(); avg.steps, avg.rounds, w.tolist()
        (2, 0, [1.0, 1.0, 1.0])
    """

    def __init__(
        self,
        params: List[torch.Tensor],
        group: Optional[dist.ProcessGroup],
        num_groups: int,
        method: Averaging,
        elastic_alpha: float,
        sync_every: int,
        background: bool = False,
        shared: Sequence[torch.Tensor] = (),
        in_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.params = list(params)
        self.shared = list(shared)
        self.group = group
        self.in_group = in_group if self.shared else None
        self.in_size = dist.get_world_size(self.in_group) if self.in_group is not None else 1
        self.in_rank = dist.get_rank(self.in_group) if self.in_group is not None else 0
        self._own_numel = sum(p.numel() for p in self.params)
        self._shared_numel = sum(p.numel() for p in self.shared)
        self._chunk = -(-self._shared_numel // self.in_size)
        self.num_groups = num_groups
        self.method = method
        self.alpha = elastic_alpha
        self.sync_every = sync_every
        self.background = background
        self.steps = 0
        self.rounds = 0
        self.wait_s = 0.0
        self.bytes_sent = 0
        self._pending: Optional[Tuple[torch.Tensor, torch.Tensor, Any]] = None
        flat: torch.Tensor
        with torch.no_grad():
            flat = self._flat()
            if group is not None:  # every group starts from the same replica: the groups' mean
                dist.all_reduce(flat, group=group)
                flat.div_(num_groups)
                self._assign(flat)
        self.center: Optional[torch.Tensor] = flat.clone() if method is Averaging.EASGD else None

    def _flat(self) -> torch.Tensor:
        """This rank's part: its own tensors, then its chunk of the shared ones (zero-padded)."""
        shared = _cat(self.shared, self._chunk * self.in_size)
        return torch.cat(
            [_cat(self.params), shared[self.in_rank * self._chunk : (self.in_rank + 1) * self._chunk]]
        )

    def _write(self, flat: torch.Tensor, add: bool) -> None:
        own, chunk = flat[: self._own_numel], flat[self._own_numel :]
        full = chunk
        if self.in_group is not None and self.in_size > 1:
            full = chunk.new_empty(self._chunk * self.in_size)
            dist.all_gather_into_tensor(full, chunk.contiguous(), group=self.in_group)
        for tensors, values in ((self.params, own), (self.shared, full)):
            offset = 0
            for p in tensors:
                v = values[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if add:
                    p.detach().add_(v)
                else:
                    p.detach().copy_(v)

    def _assign(self, flat: torch.Tensor) -> None:
        self._write(flat, add=False)

    def _add(self, flat: torch.Tensor) -> None:
        self._write(flat, add=True)

    @property
    def numel(self) -> int:
        """Elements averaged per round on this rank."""
        return self._own_numel + self._chunk

    def after_step(self) -> None:
        """Count one optimizer step; run (or launch) a round every ``sync_every`` steps."""
        self.steps += 1
        if self.steps % self.sync_every or self.group is None:
            return
        with torch.no_grad():
            self.finish()
            snapshot = self._flat()
            total = snapshot.clone()
            self.bytes_sent += total.numel() * total.element_size()
            work = dist.all_reduce(total, group=self.group, async_op=True)
            self._pending = (snapshot, total, work)
            if not self.background:
                self.finish()

    def finish(self) -> None:
        """Wait for the round in flight, if any, and apply it (every rank calls this at the same steps)."""
        if self._pending is None:
            return
        snapshot, total, work = self._pending
        self._pending = None
        start = time.perf_counter()
        work.wait()
        self.wait_s += time.perf_counter() - start
        with torch.no_grad():
            self._add(
                round_update(snapshot, total.div_(self.num_groups), self.center, self.method, self.alpha)
            )
        self.rounds += 1

    def average_now(self) -> None:
        """A blocking round that leaves every group with the same replica, the groups' mean (and the center
        there too, EASGD): training's single model at the end of a fit. Every rank calls this at the same step.
        """
        if self.group is None:
            return
        self.finish()
        with torch.no_grad():
            total = self._flat()
            self.bytes_sent += total.numel() * total.element_size()
            dist.all_reduce(total, group=self.group)
            total.div_(self.num_groups)
            self._assign(total)
            if self.center is not None:
                self.center.copy_(total)

    def distance_to_center(self) -> float:
        """L2 distance of this rank's part of the replica to the center (EASGD; 0 for ``mean``)."""
        if self.center is None:
            return 0.0
        return float(torch.linalg.vector_norm(self._flat() - self.center))

    def state_dict(self) -> Dict[str, Any]:
        """Counters and the center (call :meth:`finish` first: a round in flight is not saved)."""
        return {"steps": self.steps, "rounds": self.rounds, "center": self.center}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.rounds = int(state["rounds"])
        center = state.get("center")
        if self.center is not None and center is not None:
            self.center.copy_(center)
