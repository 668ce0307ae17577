"""A table sharded row-wise over the ranks (or hosts) of a job, reached with torch.distributed collectives.

Bagpipe keeps embedding tables on separate embedding servers; we keep them on the trainers themselves and use
the distributed engine the job already runs. Shard ``s`` holds rows ``[bounds[s], bounds[s + 1])`` in an
ordinary local store (a :class:`~torchrec_lookahead.store.TensorStore`, or a
:class:`~torchrec_lookahead.store.MmapStore` that the ranks of one host share), and every rank serves the
requests for one shard (its *server role*). Several ranks may serve the same shard when they share its
memory (one shard per host): a request goes to the server with the requester's position modulo the number
of servers, i.e. to the same local rank on the owning host.

:meth:`RowShardedStore.gather` and :meth:`RowShardedStore.scatter` are **collectives**: every rank of the
process group calls them, in the same order, with its own ids (possibly none):

1. an all-gather of a small header (a status flag and how many ids go to each rank), so that every rank
   knows the whole traffic matrix, and a refused call (an id out of range, a bad shape) raises the same
   typed error on every rank with nothing written;
2. one ``all_to_all`` of the ids (with the rows, for a scatter), ids grouped by serving rank;
3. the servers read (or write) their local shard; a gather returns the rows with a second ``all_to_all``.

A call whose ids all live in the caller's own shard on every rank skips step 2 and 3's messages.

Two threads of one rank may use the store at the same time on disjoint rows (the lookahead stager gathers
while the training thread writes back) as long as their collectives never share a process group: a call
runs on the group of the calling thread's *channel*
(:func:`~torchrec_lookahead.store.channels.collective_channel`), the default group otherwise. The stager runs
under the :data:`~torchrec_lookahead.store.channels.STAGE_CHANNEL` channel, with a wait of its own: its
collectives are issued asynchronously and waited for by
:class:`~torchrec_lookahead.distributed.lockstep.StageGathers`, which keeps the stagers of all ranks in lockstep
(a status exchanged before each plan's gathers) and bounds the wait once the rank has stopped training. The
training thread's calls wait without bound.

Initial values are those of the unsharded table (shards are created with ``row_offset``/``table_rows``, so
:func:`~torchrec_lookahead.store.init_rows` sees the table's own row indices), so a sharded run starts from
the same numbers as a run with one store.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from torchrec_lookahead.errors import ConfigError, DataError, InvalidIdError
from torchrec_lookahead.store.channels import STAGE_CHANNEL, current_channel, current_wait
from torchrec_lookahead.store.types import (
    EmbeddingStore,
    HostWindow,
    PendingPiece,
    ShapedStore,
    StoreShape,
    check_load,
)

__all__ = ["RowShardedStore", "EmptyShardStore", "row_bounds"]


def row_bounds(num_embeddings: int, num_shards: int) -> List[int]:
    """Shard boundaries of a row-wise split into ``num_shards`` contiguous, nearly equal blocks (TorchRec's
    row-wise split: ``ceil(N / S)`` rows per shard, the last ones shorter or empty).

    Example:
        >>> row_bounds(10, 3), row_bounds(2, 3)
        ([0, 4, 8, 10], [0, 1, 2, 2])

    Raises:
        ConfigError: ``num_embeddings`` or ``num_shards`` is not positive.
    """
    if num_embeddings <= 0 or num_shards <= 0:
        raise ConfigError(
            f"row_bounds needs num_embeddings > 0 and num_shards > 0 but got {num_embeddings}, {num_shards}"
        )
    per = -(-num_embeddings // num_shards)
    return [min(num_embeddings, s * per) for s in range(num_shards + 1)]


class RowShardedStore(ShapedStore):
    """One embedding table sharded row-wise over the ranks of a process group (see the module docstring).

    Construction is itself a collective (every rank checks that all ranks describe the same table and
    sharding).

    Args:
        local: the rows ``[bounds[s], bounds[s + 1])`` of the shard ``s = shard_of_rank[rank]`` this rank
            serves, indexed locally from 0 (create it with ``row_offset=bounds[s]`` and
            ``table_rows=num_embeddings`` so its initial values are the table's).
        num_embeddings: rows of the whole table.
        bounds: ``S + 1`` increasing shard boundaries from 0 to ``num_embeddings`` (see :func:`row_bounds`).
        shard_of_rank: per rank of ``group``, the shard it serves; every shard needs at least one rank.
        group: default process group of the collectives (``None``: the default group). A gloo group: the
            rows travel as CPU tensors.
        channel_groups: extra process groups by channel name
            (:func:`~torchrec_lookahead.store.channels.collective_channel`), each with the same
            ranks as ``group``, for threads whose collectives must not interleave with the default group's.

    Raises:
        ConfigError: the bounds, the server roles or the local shard do not fit together, or the ranks
            describe different tables or shardings.

    Note:
        ``full_weights``/``full_states`` gather every shard on every rank (a collective, and a copy: writes to
        the returned tensors do not reach the store). ``load`` writes each rank's own shard from the full
        tensors, without messages. ``flush`` flushes the local shard only.
    """

    @property
    def collective(self) -> bool:
        """Every data call is a collective of all ranks."""
        return True

    def __init__(
        self,
        local: EmbeddingStore,
        num_embeddings: int,
        bounds: Sequence[int],
        shard_of_rank: Sequence[int],
        group: Optional[dist.ProcessGroup] = None,
        channel_groups: Optional[Mapping[str, dist.ProcessGroup]] = None,
    ) -> None:
        self._local = local
        self._shape = StoreShape(
            local.name, int(num_embeddings), local.embedding_dim, dict(local.state_widths)
        )
        self._bounds = [int(b) for b in bounds]
        self._shard_of_rank = [int(s) for s in shard_of_rank]
        self._group_default = group
        self._channel_groups: Dict[str, dist.ProcessGroup] = dict(channel_groups or {})
        self._world = dist.get_world_size(group)
        self._rank = dist.get_rank(group)
        for name, g in self._channel_groups.items():
            if dist.get_world_size(g) != self._world or dist.get_rank(g) != self._rank:
                raise ConfigError(
                    f"channel group '{name}' of the sharded store of table '{local.name}' must have the same "
                    "ranks as the default group"
                )
        problem = self._check_local()
        # Every rank must describe the same table and sharding: exchange the descriptions (a collective,
        # reached even by a rank whose own description is wrong, so that every rank raises together).
        desc = (
            problem,
            local.name,
            self.num_embeddings,
            local.embedding_dim,
            sorted(local.state_widths.items()),
            self._bounds,
            self._shard_of_rank,
            local.host_window,  # each shard's own: not compared
        )
        found: List[Any] = [None] * self._world
        dist.all_gather_object(found, desc, group=group)
        problems = [f"rank {r}: {d[0]}" for r, d in enumerate(found) if d[0]]
        if problems:
            raise ConfigError(f"sharded store of table '{local.name}': " + "; ".join(problems))
        if any(d[1:-1] != found[0][1:-1] for d in found):
            raise ConfigError(
                f"ranks describe the sharded store of table '{local.name}' differently: "
                + "; ".join(f"rank {r}: {d[1:-1]}" for r, d in enumerate(found))
            )
        self._host_window = self._shards_window([d[-1] for d in found])
        shard = self._shard_of_rank[self._rank]
        self._shard = shard
        self._lo, self._hi = self._bounds[shard], self._bounds[shard + 1]
        servers = [
            [r for r, s in enumerate(self._shard_of_rank) if s == k] for k in range(len(self._bounds) - 1)
        ]
        self._first_server = [srv[0] for srv in servers]
        # The rank serving each shard for this rank: itself when it serves the shard, else the server at the
        # same position (the same local rank on the owning host, when a host's ranks serve its shard).
        route = [self._rank if self._rank in srv else srv[self._rank % len(srv)] for srv in servers]
        self._route = torch.tensor(route, dtype=torch.int64)
        self._upper = torch.tensor(self._bounds[1:], dtype=torch.int64)

    def _shards_window(self, local_windows: List[Optional[HostWindow]]) -> Optional[HostWindow]:
        """The table's host window from each rank's local one (the same on every rank): a shard's rows are its
        first server's host tier's, or the shard's own row count where it has no bounded tier."""
        if all(w is None for w in local_windows):
            return None
        rows = []
        for k in range(len(self._bounds) - 1):
            w = local_windows[self._shard_of_rank.index(k)]
            rows.append(self._bounds[k + 1] - self._bounds[k] if w is None else w.rows[0])
        known = [w for w in local_windows if w is not None]
        return HostWindow(
            max(w.depth for w in known),
            tuple(self._bounds),
            tuple(rows),
            known[0].policy,
            known[0].row_bytes,
            known[0].budget_split,
        )

    def _check_local(self) -> str:
        b, roles = self._bounds, self._shard_of_rank
        if self.num_embeddings <= 0:
            return f"num_embeddings must be > 0 but is {self.num_embeddings}"
        if len(b) < 2 or b[0] != 0 or b[-1] != self.num_embeddings or any(x > y for x, y in zip(b, b[1:])):
            return f"bounds {b} must increase from 0 to num_embeddings={self.num_embeddings}"
        if len(roles) != self._world:
            return f"shard_of_rank {roles} must name one shard per rank ({self._world} ranks)"
        if any(not 0 <= s < len(b) - 1 for s in roles):
            return f"shard_of_rank {roles} names a shard outside [0, {len(b) - 1})"
        missing = sorted(set(range(len(b) - 1)) - set(roles))
        if missing:
            return f"shards {missing} have no rank serving them (shard_of_rank={roles})"
        s = roles[self._rank]
        rows = b[s + 1] - b[s]
        if self._local.num_embeddings != rows:
            return (
                f"the local store of shard {s} has {self._local.num_embeddings} rows but the shard has {rows} "
                f"(rows [{b[s]}, {b[s + 1]}))"
            )
        offset = getattr(self._local, "row_offset", b[s])
        table_rows = getattr(self._local, "table_rows", self.num_embeddings)
        if offset != b[s] or table_rows != self.num_embeddings:
            return (
                f"the local store of shard {s} was created with row_offset={offset}, table_rows={table_rows}; "
                f"expected row_offset={b[s]}, table_rows={self.num_embeddings} (or its initial values differ from the "
                "unsharded table's)"
            )
        return ""

    # -- properties ----------------------------------------------------------------------------------------
    @property
    def local(self) -> EmbeddingStore:
        """The local shard's store (local row ids)."""
        return self._local

    @property
    def shard(self) -> int:
        """Index of the shard this rank serves."""
        return self._shard

    @property
    def bounds(self) -> List[int]:
        """Shard boundaries."""
        return list(self._bounds)

    @property
    def local_rows(self) -> Tuple[int, int]:
        """``(lo, hi)``: the table rows of this rank's shard."""
        return self._lo, self._hi

    @property
    def disk_prefetch_depth(self) -> int:
        return self._local.disk_prefetch_depth

    @property
    def host_window(self) -> Optional[HostWindow]:
        """Every shard's host tier (exchanged at construction, so the same on every rank): each rank checks
        every shard, and a window that does not fit is refused on every rank alike."""
        return self._host_window

    def stage_group(self) -> Optional[dist.ProcessGroup]:
        """The :data:`~torchrec_lookahead.store.channels.STAGE_CHANNEL` group."""
        return self.channel_group(STAGE_CHANNEL)

    def channel_group(self, name: Optional[str]) -> Optional[dist.ProcessGroup]:
        """The process group the calls of channel ``name`` run on (``None``: the default group of
        torch.distributed)."""
        if name is not None and name in self._channel_groups:
            return self._channel_groups[name]
        return self._group_default

    # -- helpers -------------------------------------------------------------------------------------------
    def _group(self) -> Optional[dist.ProcessGroup]:
        return self.channel_group(current_channel())

    @staticmethod
    def _run(what: str, op: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Issue one collective; with the thread's :func:`current_wait`, asynchronously and waited by it."""
        wait = current_wait()
        if wait is None:
            op(*args, **kwargs)
        else:
            wait(op(*args, async_op=True, **kwargs), what)

    def _pack(
        self, n: int, weights: Any, states: Optional[Mapping[str, torch.Tensor]]
    ) -> Tuple[Optional[BaseException], torch.Tensor]:
        dim = self.embedding_dim
        empty = torch.zeros(0, self.row_width)
        states = dict(states or {})
        if set(states) != set(self._shape.state_widths):
            return DataError(
                f"states for table '{self.name}' must have exactly the keys {sorted(self._shape.state_widths)} but got "
                f"{sorted(states)}"
            ), empty
        if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (n, dim):
            shape = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
            return DataError(
                f"weights for table '{self.name}' must have shape ({n}, {dim}) but got {shape}"
            ), empty
        parts = [weights.detach().to("cpu", torch.float32)]
        for key, width in self._shape.state_widths.items():
            val = states[key].detach()
            if width == 1 and val.dim() == 1:
                val = val.unsqueeze(1)
            if tuple(val.shape) != (n, width):
                return DataError(
                    f"state '{key}' for table '{self.name}' must have shape ({n}, {width}) but got "
                    f"{tuple(states[key].shape)}"
                ), empty
            parts.append(val.to("cpu", torch.float32))
        return None, torch.cat(parts, 1)

    def _split(self, rows: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        return self._shape.split(rows)

    def plan_reads(self, step: int, ids: torch.Tensor) -> None:
        """Hands the local shard the hinted ids it holds (local, not a collective)."""
        ids = ids.reshape(-1)
        mine = ids[(ids >= self._lo) & (ids < self._hi)]
        self._local.plan_reads(step, mine - self._lo)

    @property
    def uses_hints(self) -> bool:
        return self._local.uses_hints

    def plan_uses(self, step: int, ids: torch.Tensor) -> None:
        """Hands the local shard the looked-up ids it holds (local, not a collective)."""
        ids = ids.reshape(-1)
        mine = ids[(ids >= self._lo) & (ids < self._hi)]
        self._local.plan_uses(step, mine - self._lo)

    def at_step(self, step: int) -> None:
        """Tells the local shard (local, not a collective)."""
        self._local.at_step(step)

    def _local_rows(self, local_ids: torch.Tensor) -> torch.Tensor:
        w, s = self._local.gather(local_ids)
        return torch.cat([w, *(s[k].reshape(-1, v) for k, v in self._shape.state_widths.items())], 1)

    def _header(
        self, group: Optional[dist.ProcessGroup], error: Optional[BaseException], counts: torch.Tensor
    ) -> torch.Tensor:
        """All-gather ``[status, counts per destination]``; raise ``error`` (or a peer's) on every rank."""
        mine = torch.cat([torch.tensor([0 if error is None else 1], dtype=torch.int64), counts])
        parts = [torch.zeros_like(mine) for _ in range(self._world)]
        self._run(f"header of table '{self.name}'", dist.all_gather, parts, mine, group=group)
        out = torch.stack(parts)
        if bool(out[:, 0].any()):
            errs: List[Any] = [None] * self._world
            payload = None if error is None else (type(error).__name__, str(error))
            dist.all_gather_object(errs, payload, group=group)
            if error is not None:
                raise error
            r, (kind, msg) = next((r, e) for r, e in enumerate(errs) if e is not None)
            cls = {"InvalidIdError": InvalidIdError, "DataError": DataError}.get(kind, DataError)
            raise cls(f"rank {r} refused the collective call: {msg}")
        return out[:, 1:]

    def _route_ids(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Order of ``ids`` grouped by serving rank, and how many go to each rank."""
        shard = torch.searchsorted(self._upper, ids, right=True)
        dest = self._route[shard]
        order = torch.argsort(dest, stable=True)
        counts = torch.bincount(dest, minlength=self._world)
        return order, dest, counts

    # -- EmbeddingStore ------------------------------------------------------------------------------------
    def gather(self, ids: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """Read rows from their shards (a collective: every rank calls it, with its own ids or none).

        Raises:
            InvalidIdError: an id of this or another rank is out of range, or ``ids`` is not a 1-D integer
                tensor (raised on every rank).
        """
        group = self._group()
        error, ids = self._shape.check_ids(ids, unique=False)
        order, _, counts = self._route_ids(ids)
        matrix = self._header(group, error, counts)
        width = self.row_width
        off_diag = matrix.clone()
        off_diag.fill_diagonal_(0)
        if not bool(off_diag.any()):  # every rank reads its own shard only: no messages
            rows = self._local_rows(ids - self._lo) if ids.numel() else torch.zeros(0, width)
            return self._split(rows)
        send = ids[order]
        recv_counts = matrix[:, self._rank].tolist()
        send_counts = counts.tolist()
        recv = torch.empty(sum(recv_counts), dtype=torch.int64)
        self._run(
            f"ids of table '{self.name}'",
            dist.all_to_all_single,
            recv,
            send,
            recv_counts,
            send_counts,
            group=group,
        )
        served = self._local_rows(recv - self._lo) if recv.numel() else torch.zeros(0, width)
        back = torch.empty(ids.numel(), width)
        self._run(
            f"rows of table '{self.name}'",
            dist.all_to_all_single,
            back,
            served.contiguous(),
            send_counts,
            recv_counts,
            group=group,
        )
        rows = torch.empty_like(back)
        rows[order] = back
        return self._split(rows)

    def scatter(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        states: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> None:
        """Write rows into their shards (a collective: every rank calls it, with its own rows or none).

        Ids must be distinct, also across ranks (each row written by one rank per call).

        Raises:
            InvalidIdError: an id of this or another rank is out of range or repeated; nothing is written.
            DataError: a shape or a state name does not match (on any rank); nothing is written.
        """
        group = self._group()
        error: Optional[BaseException]
        error, ids = self._shape.check_ids(ids, unique=True)
        packed = torch.zeros(0, self.row_width)
        if error is None:
            error, packed = self._pack(ids.numel(), weights, states)
        if error is not None:
            ids = ids[:0]
        order, _, counts = self._route_ids(ids)
        matrix = self._header(group, error, counts)
        if not bool(matrix.any()):
            return
        off_diag = matrix.clone()
        off_diag.fill_diagonal_(0)
        if not bool(off_diag.any()):
            if ids.numel():
                w, s = self._split(packed)
                self._local.scatter(ids - self._lo, w, s)
            return
        # ids travel in the same message as the rows, as pairs of float32 words (bit-exact).
        payload = torch.cat([ids[order].view(torch.float32).view(-1, 2), packed[order]], 1).contiguous()
        recv_counts = matrix[:, self._rank].tolist()
        recv = torch.empty(sum(recv_counts), payload.shape[1])
        self._run(
            f"rows of table '{self.name}'",
            dist.all_to_all_single,
            recv,
            payload,
            recv_counts,
            counts.tolist(),
            group=group,
        )
        if recv.numel():
            got_ids = recv[:, :2].reshape(-1).view(torch.int64)  # reshape: contiguous even for one row
            w, s = self._split(recv[:, 2:])
            self._local.scatter(got_ids - self._lo, w, s)

    def _full_rows(self) -> torch.Tensor:
        group = self._group()
        width = self.row_width
        rows = max(b - a for a, b in zip(self._bounds, self._bounds[1:]))
        mine = torch.zeros(rows, width)
        n = self._hi - self._lo
        if n:
            mine[:n] = self._local_rows(torch.arange(n))
        parts = [torch.empty(rows, width) for _ in range(self._world)]
        self._run(f"shards of table '{self.name}'", dist.all_gather, parts, mine, group=group)
        out = torch.empty(self.num_embeddings, width)
        for s, (a, b) in enumerate(zip(self._bounds, self._bounds[1:])):
            out[a:b] = parts[self._first_server[s]][: b - a]
        return out

    def full_weights(self) -> torch.Tensor:
        """The whole table on every rank: a collective, and a copy (writes do not reach the store)."""
        return self._split(self._full_rows())[0]

    def full_states(self) -> Dict[str, torch.Tensor]:
        """The whole optimizer state on every rank: a collective, and a copy."""
        return self._split(self._full_rows())[1]

    def load(self, weights: torch.Tensor, states: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        """Overwrite this rank's shard from the whole table's tensors (no messages; call it on every rank).

        Raises:
            DataError: a shape or a state name does not match; nothing is written.
        """
        states = check_load(self._shape, weights, states)
        lo, hi = self._lo, self._hi
        self._local.load(weights[lo:hi], {k: v[lo:hi] for k, v in states.items()})

    def flush(self) -> None:
        """Make this rank's shard durable (each rank flushes the shard it serves)."""
        self._local.flush()

    @property
    def keeps_files(self) -> bool:
        """Whether the shards are kept as files (the same on every rank)."""
        return self._local.keeps_files

    def keep_files(self) -> None:
        """Have checkpoints keep this rank's shard as pieces (each rank its own, no messages).

        Raises:
            ConfigError: the shard is served by several ranks (one memory-mapped file per host).
        """
        if self._shard_of_rank.count(self._shard) > 1 and not self._local.keeps_files:
            raise ConfigError(
                f"table '{self.name}': shard {self._shard} is shared by {self._shard_of_rank.count(self._shard)} "
                "ranks; checkpoints keep in-memory shards as pieces with one rank per shard "
                "(store_sharding: row_wise)"
            )
        self._local.keep_files()

    def save_files(self, directory: str, max_chain: int = 1) -> List[str]:
        """Write a checkpoint piece of this rank's shard into ``directory`` (no messages; every rank its own)."""
        return self._local.save_files(directory, max_chain)

    def snapshot_files(self, directory: str, max_chain: int = 1) -> Tuple[List[str], Optional[PendingPiece]]:
        """:meth:`save_files`, the piece's writing left to the returned writer (this rank's shard)."""
        return self._local.snapshot_files(directory, max_chain)

    def load_files(self, pieces: Sequence[str]) -> None:
        """Load this rank's shard from its chain of pieces (no messages)."""
        self._local.load_files(pieces)

    def __repr__(self) -> str:
        return (
            f"RowShardedStore(name={self.name!r}, num_embeddings={self.num_embeddings}, bounds={self._bounds}, "
            f"shard={self._shard}, rank={self._rank}/{self._world})"
        )


class EmptyShardStore(ShapedStore):
    """The local store of an empty shard (a table with fewer rows than shards): no rows, nothing to do.

    Example:
        >>> s = EmptyShardStore("t", 4, {"momentum1": 1})
        >>> s.gather(torch.zeros(0, dtype=torch.long))[0].shape
        torch.Size([0, 4])
    """

    def __init__(
        self,
        name: str,
        embedding_dim: int,
        state_widths: Optional[Mapping[str, int]] = None,
        keeps_files: bool = False,
    ) -> None:
        widths = {k: int(v) for k, v in (state_widths or {}).items()}
        self._shape = StoreShape(str(name), 0, int(embedding_dim), widths)
        self._keeps_files = bool(
            keeps_files
        )  # as the other shards of its table (disk stores): no file of its own

    def _empty(self) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        return self._shape.split(torch.zeros(0, self.row_width))

    def gather(self, ids: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        if not isinstance(ids, torch.Tensor) or ids.numel():
            raise InvalidIdError(f"the empty shard of table '{self.name}' holds no rows")
        return self._empty()

    def scatter(
        self, ids: torch.Tensor, weights: torch.Tensor, states: Optional[Mapping[str, torch.Tensor]] = None
    ) -> None:
        if not isinstance(ids, torch.Tensor) or ids.numel():
            raise InvalidIdError(f"the empty shard of table '{self.name}' holds no rows")

    def full_weights(self) -> torch.Tensor:
        return self._empty()[0]

    def full_states(self) -> Dict[str, torch.Tensor]:
        return self._empty()[1]

    def load(self, weights: torch.Tensor, states: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        if weights.shape[0] != 0:
            raise DataError(f"the empty shard of table '{self.name}' cannot load {weights.shape[0]} rows")

    def flush(self) -> None:
        """Nothing to flush."""

    @property
    def keeps_files(self) -> bool:
        return self._keeps_files

    def keep_files(self) -> None:
        """No rows: nothing to track."""
        self._keeps_files = True

    def save_files(self, directory: str, max_chain: int = 1) -> List[str]:
        """No rows, no piece."""
        return []

    def load_files(self, pieces: Sequence[str]) -> None:
        """No rows, no piece."""
