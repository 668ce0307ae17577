"""Checkpoints of a sharded model: directories written by :mod:`torch.distributed.checkpoint` on every rank, with
the Lightning part and the rank count in a small file beside them (:data:`META_FILE`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from torchrec_lookahead.errors import CheckpointError, ConfigError, StoreError
from torchrec_lookahead.modules._checkpoint import StoreFiles
from torchrec_lookahead.store import EmbeddingStore

__all__ = [
    "META_FILE",
    "STORE_FILES_DIR",
    "WORLD_SIZE_KEY",
    "checkpoint_memory_shortfall",
    "load_sharded",
    "load_store_files",
    "memory_available",
    "read_checkpoint_meta",
]

#: the Lightning part of a checkpoint directory (epoch, loops, callbacks), written by rank 0
META_FILE = "meta.pt"
#: the key of the rank count that wrote the checkpoint, in :data:`META_FILE`
WORLD_SIZE_KEY = "torchrec_lookahead_world_size"
#: the sub-directory of a checkpoint holding copies of disk stores' files: ``rank<r>/<collection>.<table>/``
STORE_FILES_DIR = "stores"


def load_sharded(target: Dict[str, Any], path: Path) -> None:
    """Read the distributed checkpoint ``path`` into ``target`` in place (torch.distributed.checkpoint, every rank).

    Raises:
        CheckpointError: its shard files are damaged or incomplete, or it belongs to another model or
            configuration (the first line of the rank's own error is quoted).
    """
    try:
        dcp.load(target, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # CheckpointException derives from BaseException
        failures = getattr(e, "failures", None) or {}
        cause = next(iter(failures.values()), e)  # a CheckpointException holds each rank's own error
        cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, traceback)
        first = (str(cause).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"checkpoint {path} could not be read ({type(cause).__name__}: {first[:300]}): its shard files are "
            "damaged or incomplete (a truncated .distcp file?), or it was written for another model or "
            "configuration; resume from an intact checkpoint of this configuration"
        ) from e


def load_store_files(files: StoreFiles, path: Path, rank: int) -> None:
    """Load this rank's tables kept in files from checkpoint ``path`` (see :data:`STORE_FILES_DIR`).

    Raises:
        CheckpointError: a copy is missing, damaged or of another table, shard, layout or seed.
    """
    directory = path / STORE_FILES_DIR / f"rank{rank}"
    try:
        files.load(str(directory))
    except (ConfigError, StoreError) as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"checkpoint {path}: the copies of the disk stores' files under {directory} could not be loaded "
            f"({first[:400]}); resume from an intact checkpoint of this configuration"
        ) from e


def read_checkpoint_meta(path: Path, world_size: int) -> Dict[str, Any]:
    """The Lightning part of the checkpoint directory ``path``, after checking that the directory is whole
    and was written by as many ranks as this run has.

    Raises:
        CheckpointError: the path does not exist, is a file (an exported checkpoint, read with
            ``strategy='auto'``), is not a checkpoint of this strategy, lacks
            torch.distributed.checkpoint's ``.metadata``, or was written by another number of ranks.
    """
    if not path.exists():
        raise CheckpointError(
            f"checkpoint {path} does not exist; check ckpt_path (under strategy='torchrec' a checkpoint is the "
            "directory ModelCheckpoint wrote, e.g. <dirpath>/epoch=0-step=100.ckpt)"
        )
    if path.is_file():
        raise CheckpointError(
            f"{path} is a checkpoint file, not a directory written by TorchRecStrategy: an ordinary checkpoint "
            "(of `export`, or of the resident model trained with strategy='auto') is read by the plain model; "
            "run with --trainer.strategy=auto (in Python, Trainer(strategy='auto')) to evaluate or serve it"
        )
    if not (path / META_FILE).is_file():
        raise CheckpointError(
            f"{path} is not a checkpoint written by TorchRecStrategy (no {META_FILE} inside); checkpoints of "
            "sharded models are directories written by torch.distributed.checkpoint on every rank"
        )
    if not (path / ".metadata").is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: torch.distributed.checkpoint's .metadata file is missing (the save "
            "was interrupted, or files were lost in a copy); resume from another checkpoint"
        )
    try:
        meta: Dict[str, Any] = torch.load(path / META_FILE, weights_only=False)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path}: {META_FILE} could not be read ({type(e).__name__}); the file is damaged, "
            "resume from another checkpoint"
        ) from e
    saved = meta.pop(WORLD_SIZE_KEY, None)
    if saved is not None and int(saved) != world_size:
        raise CheckpointError(
            f"checkpoint {path} was written by {saved} ranks but this run has {world_size}: each rank's "
            f"data position and cache state belong to a {saved}-rank job; resume it with {saved} ranks "
            f"(torchrun --nproc_per_node=... and --trainer.devices so that they make {saved}), or start a new run"
        )
    return meta


def memory_available() -> Optional[int]:
    """The bytes this machine can still give processes without swapping (``MemAvailable`` of ``/proc/meminfo``;
    ``None`` where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _size(n: int) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"


def checkpoint_memory_shortfall(
    stores: Sequence[EmbeddingStore], processes: int = 1, available: Optional[int] = None
) -> Optional[str]:
    """Why a checkpoint of the cached tables in ``stores`` cannot be held in this machine's memory, or ``None``.

    A checkpoint holds every cached table in full, as a resident model's state dict does, except those it keeps
    as copies of their store files (:attr:`~torchrec_lookahead.store.EmbeddingStore.keeps_files`: disk stores):
    saving copies each table and its optimizer state out of its store, and resuming reads each table into such
    a copy before loading it into the store; each of the node's ``processes`` ranks holds the whole
    tables. The estimate is the tables' bytes plus the largest table's once more (the checkpoint reader's
    buffer), per process, against ``available`` (default :func:`memory_available`).

    Example:
        >>> from torchrec_lookahead.store import TensorStore
        >>> store = TensorStore(1000, 16, {"momentum1": 1}, name="t")
        >>> checkpoint_memory_shortfall([store], available=10**9) is None
        True
        >>> print(checkpoint_memory_shortfall([store], available=10**5))  # doctest: +ELLIPSIS
        checkpoints hold the cached tables in full: 0.13 MiB per rank (t 0.0648 MiB), 0.0954 MiB available for 1 ...
    """
    available = memory_available() if available is None else available
    stores = [
        s for s in stores if not s.keeps_files
    ]  # kept as copies of their files, a run of units at a time
    if available is None or not stores:
        return None
    sizes = sorted(((s.nbytes, s.name) for s in stores), reverse=True)
    need = (sum(n for n, _ in sizes) + sizes[0][0]) * max(1, processes)
    if need <= available:
        return None
    largest = ", ".join(f"{name} {_size(n)}" for n, name in sizes[:3])
    return (
        f"checkpoints hold the cached tables in full: {_size(need // max(1, processes))} per rank ({largest}"
        f"{', ...' if len(sizes) > 3 else ''}), {_size(available)} available for "
        f"{max(1, processes)} rank(s) on this machine (a checkpoint that keeps the store files instead is not "
        "built yet); give the machine more memory, run fewer ranks on it, or train without checkpoints "
        "(--trainer.enable_checkpointing=false; Trainer(enable_checkpointing=False)), knowing that nothing of "
        "the run is kept"
    )
