"""Writing a checkpoint directory of :class:`~torchrec_lookahead.strategies.TorchRecStrategy`, in the foreground or
with its store pieces in the background (``async_checkpoints``).

In the background, the training thread stops for what consistency needs: the flush of the cached rows and the host tiers
(when the state dict is built), a snapshot of each piece (a copy of the rows a delta holds; a full piece holds its store
as it is: an in-memory store saves the old value of a row written before the piece has copied it, a disk store keeps the
log units the piece still has to copy from reuse, and copies its index), the chains' files, and the dense part
(``torch.distributed.checkpoint``, small). The pieces are then written by one thread per rank; each rank marks its part
written (:data:`WRITTEN`), and rank 0 writes the Lightning part
(:data:`~torchrec_lookahead.strategies._checkpoint.META_FILE`) once every rank's is, then renames the directory from its
writing name to its own (``last.ckpt`` rewritten stays the previous one until then). A second checkpoint waits for the
first; the end of fit waits for the last; a failure is raised at the next checkpoint or at the end of fit, the failed
checkpoint's directory removed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from torchrec_lookahead._disk_space import free_bytes, out_of_space
from torchrec_lookahead.errors import CheckpointError
from torchrec_lookahead.modules.checkpoint_files import StoreFiles
from torchrec_lookahead.store.types import PendingPiece
from torchrec_lookahead.strategies._checkpoint import (
    META_FILE,
    STORE_FILES_DIR,
    WORLD_SIZE_KEY,
    collect_pieces,
    publish,
    remove_checkpoint_dir,
    save_store_files,
    writing_path,
)

__all__ = ["WRITTEN", "PiecesWriter", "write_checkpoint"]

#: in ``stores/rank<r>/`` of a checkpoint written in the background: rank r's pieces are written (or ``FAILED``)
WRITTEN = "WRITTEN"
_FAILED = "FAILED"
_WAIT_S = 1800.0  # rank 0 waits this long for the other ranks' pieces


class PiecesWriter:
    """One background thread writing one checkpoint's pieces at a time."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def wait(self) -> None:
        """Wait for the checkpoint being written, and raise what made it fail."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def start(self, work: Callable[[], None]) -> None:
        """Run ``work`` in the background, after the previous checkpoint is written."""
        self.wait()

        def run() -> None:
            try:
                work()
            except BaseException as e:  # raised at the next wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="checkpoint-pieces", daemon=True)
        self._thread.start()


def _wait_for_ranks(path: Path, world_size: int) -> None:
    deadline = time.monotonic() + _WAIT_S
    for r in range(world_size):
        mine = path / STORE_FILES_DIR / f"rank{r}"
        while not (mine / WRITTEN).exists():
            if (mine / _FAILED).exists() or time.monotonic() > deadline:
                raise CheckpointError(
                    f"checkpoint {path}: rank {r} did not write its store pieces; the checkpoint is removed, the "
                    "earlier ones are whole"
                )
            time.sleep(0.02)


def write_checkpoint(
    checkpoint: Dict[str, Any],
    final: Path,
    files: Optional[StoreFiles],
    rank: int,
    world_size: int,
    max_chain: int,
    background: Optional[PiecesWriter],
) -> None:
    """Write checkpoint ``final`` on this rank, under its :func:`~torchrec_lookahead.strategies._checkpoint.
    writing_path` (made, empty, by rank 0): the store pieces and chains, the sharded state
    (``torch.distributed.checkpoint``, collective) and, on rank 0, the Lightning part last, then the whole
    directory renamed to ``final``. With ``background``, the pieces, the Lightning part and the rename are done by
    its thread.

    Raises:
        StoreError: a piece cannot be written; the checkpoint's directory (rank 0) and this rank's new pieces
            are removed.
        CheckpointError: the disk is full while the sharded state or the Lightning part is written; the
            checkpoint's directory (rank 0) and this rank's new pieces are removed.
    """
    path = writing_path(final)
    writers: List[PendingPiece] = []
    free = free_bytes(final.parent)  # before: a failed write may hold its bytes a while
    needed = _state_bytes(checkpoint)
    try:
        writers = save_store_files(files, path, rank, max_chain) if files else []
        if background is None:  # before the shards: a checkpoint killed while writing lacks .metadata
            _write_all(writers)
        sharded = {"state_dict": checkpoint.pop("state_dict")}
        for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
            sharded[f"optimizer_{i}"] = opt_state
        dcp.save(sharded, checkpoint_id=path)
        checkpoint[WORLD_SIZE_KEY] = world_size
        if background is None:
            if rank == 0:
                torch.save(checkpoint, path / META_FILE)
                publish(path, final)
            return
    except BaseException as e:
        for pending in writers:  # those not written let go of what they hold
            pending.drop()
        _remove(path, rank)
        _raise_if_full(e, final, needed, free)
        raise
    mine = path / STORE_FILES_DIR / f"rank{rank}"
    mine.mkdir(parents=True, exist_ok=True)

    def finish(writers: List[PendingPiece] = writers) -> None:
        try:
            _write_all(writers)
            (mine / WRITTEN).touch()
            if rank == 0:
                _wait_for_ranks(path, world_size)
                torch.save(checkpoint, path / META_FILE)
                publish(path, final)
                collect_pieces(final.parent)  # the pieces only the checkpoint it replaced named
        except BaseException as e:
            if mine.is_dir():
                (mine / _FAILED).touch()
            _remove(path, rank)
            _raise_if_full(e, final, needed, free)
            raise

    background.start(finish)


def _state_bytes(checkpoint: Dict[str, Any]) -> Optional[int]:
    """The bytes of this rank's tensors in ``checkpoint`` (its local shards), or ``None`` if they cannot be
    counted."""
    total = 0
    todo: List[Any] = [checkpoint]
    try:
        while todo:
            value = todo.pop()
            if isinstance(value, dict):
                todo.extend(value.values())
            elif isinstance(value, (list, tuple)):
                todo.extend(value)
            elif isinstance(value, ShardedTensor):  # this rank's shards
                todo.extend(shard.tensor for shard in value.local_shards())
            elif isinstance(value, DTensor):
                todo.append(value.to_local())
            elif isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    except Exception:  # noqa: BLE001 - a count for a message only
        return None
    return total


def _raise_if_full(e: BaseException, final: Path, needed: Optional[int], free: Optional[int]) -> None:
    """Raise a :class:`CheckpointError` for ``e`` if it is a full disk (the checkpoint is already removed)."""
    if (
        not isinstance(e, (Exception, CheckpointException))
        or isinstance(e, CheckpointError)
        or not out_of_space(e)
    ):
        return
    size = "" if needed is None else f"this rank's part takes about {needed:,} bytes; "
    room = "unknown" if free is None else f"{free:,}"
    raise CheckpointError(
        f"cannot write the checkpoint {final}: no space left on the disk of {final.parent} ({size}{room} bytes "
        "were free there); the checkpoint is removed, the earlier ones are whole: free space, or point "
        "ModelCheckpoint's dirpath (or --trainer.default_root_dir) at a disk with room"
    ) from e


def _write_all(writers: List[PendingPiece]) -> None:
    """Write the pieces in order; after a failure, drop the rest."""
    try:
        for write in writers:
            write()
    finally:
        for pending in writers:
            pending.drop()


def _remove(path: Path, rank: int) -> None:
    """A failed checkpoint leaves nothing behind: rank 0 removes its directory, then the pieces no kept one names."""
    if rank == 0:
        remove_checkpoint_dir(path)
