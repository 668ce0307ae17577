"""Checkpoints of a sharded model: directories written by :mod:`torch.distributed.checkpoint` on every rank, with
the Lightning part and the rank count in a small file beside them (:data:`META_FILE`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from torchrec_lookahead.errors import CheckpointError, ConfigError, StoreError, first_line
from torchrec_lookahead.modules.checkpoint_files import StoreFiles
from torchrec_lookahead.store import EmbeddingStore
from torchrec_lookahead.store.types import PendingPiece

__all__ = [
    "CHAIN_FILE",
    "META_FILE",
    "PIECES_DIR",
    "STORE_FILES_DIR",
    "WORLD_SIZE_KEY",
    "checkpoint_memory_shortfall",
    "check_dcp_metadata",
    "check_not_inside_checkpoint",
    "collect_pieces",
    "keep_store_files",
    "load_meta_file",
    "load_sharded",
    "load_store_files",
    "memory_available",
    "publish",
    "read_chain",
    "read_checkpoint_meta",
    "remove_checkpoint_dir",
    "remove_unpublished",
    "save_store_files",
    "writing_path",
]

#: the Lightning part of a checkpoint directory (epoch, loops, callbacks), written by rank 0
META_FILE = "meta.pt"
#: the key of the rank count that wrote the checkpoint, in :data:`META_FILE`
WORLD_SIZE_KEY = "torchrec_lookahead_world_size"
#: the sub-directory of a checkpoint naming the pieces of disk stores' files it needs:
#: ``rank<r>/<collection>.<table>/`` :data:`CHAIN_FILE`
STORE_FILES_DIR = "stores"
#: the file naming a table's chain of pieces, oldest (the full piece) first
CHAIN_FILE = "chain.json"
#: beside the checkpoints (in their parent directory), the pieces of disk stores' files the checkpoints share:
#: ``rank<r>/<collection>.<table>/<piece>``, each kept while a checkpoint there names it
PIECES_DIR = ".store_pieces"
#: the prefix of a checkpoint being written (a sibling of its final path, renamed to it once whole)
WRITING_PREFIX = ".writing-"
_PARTIAL_AGE_S = 3600.0  # a partial piece younger than this may still be being written
# held while checkpoints of a directory are renamed or removed, or its pool collected: the background writer's
# rename and the training thread's collection never see each other half done
_POOL_LOCK = threading.RLock()


def _pieces_dir(path: Path, rank: int, key: str) -> Path:
    return path.parent / PIECES_DIR / f"rank{rank}" / key


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def writing_path(final: Path) -> Path:
    """Where checkpoint ``final`` is written before :func:`publish` gives it its name: a sibling (its pieces go
    in the same pool) whose name holds neither ``last`` nor ``.ckpt``, so that Lightning's ``ckpt_path="last"``
    never picks a checkpoint in writing."""
    return final.with_name(WRITING_PREFIX + hashlib.sha1(final.name.encode()).hexdigest()[:16])


def publish(writing: Path, final: Path) -> None:
    """Rename the whole checkpoint ``writing`` to ``final``. A checkpoint rewritten in place (``last.ckpt``)
    stays whole, and loadable, until the new one replaces it: a process killed while writing leaves the
    previous one (and the partial one under its writing name, removed by the next checkpoint). The two swap
    places in one step where the filesystem can (:func:`_exchange`); elsewhere ``final`` is missing between two
    renames, and a process killed there leaves the previous checkpoint under ``<writing>.old`` only."""
    old = writing.with_name(writing.name + ".old")
    with _POOL_LOCK:
        if os.path.lexists(final):
            if _exchange(writing, final):  # the new one in place, the previous one under the writing name
                _remove_path(writing)
                return
            _remove_path(old)
            os.rename(final, old)
        os.rename(writing, final)
        _remove_path(old)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` atomically (Linux's ``renameat2`` with ``RENAME_EXCHANGE``); ``False``
    where the platform, the C library or the filesystem cannot (nothing changed then).

    Raises:
        OSError: the exchange failed for another reason (a missing path, no permission).
    """
    import ctypes
    import errno
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without renameat2 (glibc < 2.28, some others)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EXDEV):  # not supported here
        return False
    raise OSError(err, os.strerror(err), os.fspath(a))


def remove_unpublished(directory: Path) -> None:
    """Remove the checkpoints in writing under ``directory`` that a killed or failed process left (call it when
    none of this run's is in writing)."""
    with _POOL_LOCK:
        for left in directory.glob(WRITING_PREFIX + "*") if directory.is_dir() else ():
            _remove_path(left)


def remove_checkpoint_dir(path: Path) -> None:
    """Remove checkpoint ``path``, then the pieces no checkpoint left beside it names."""
    with _POOL_LOCK:
        _remove_path(path)
        collect_pieces(path.parent)


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def keep_store_files(stores: Sequence[EmbeddingStore]) -> None:
    """Have checkpoints keep every cached table in ``stores`` as pieces, in-memory ones too (deltas of the rows
    written since the previous checkpoint; ``incremental_ram_stores``).

    Raises:
        ConfigError: a store that cannot (one the ranks of a host share: ``store_sharding: row_wise`` can).
    """
    for store in stores:
        store.keep_files()


def save_store_files(files: StoreFiles, path: Path, rank: int, max_chain: int) -> List[PendingPiece]:
    """Take a piece of every disk store's file on this rank (a delta over its chain while the chain has fewer
    than ``max_chain`` pieces) beside checkpoint ``path``, under :data:`PIECES_DIR`, and name each table's chain
    in ``path`` (:data:`STORE_FILES_DIR`). The pieces are taken here (:meth:`EmbeddingStore.snapshot_files`: a
    delta's rows copied, a full piece's held) and written by the returned writers, on any thread.

    Raises:
        StoreError: a piece cannot be taken (a full disk: the free and needed bytes are named); the pieces this
            call took are dropped and this rank's part of ``path`` removed.
    """
    mine = path / STORE_FILES_DIR / f"rank{rank}"
    chains: Dict[str, List[str]] = {}
    writers: List[PendingPiece] = []
    try:
        for key, store in files.stores.items():
            chains[key], write = store.snapshot_files(str(_pieces_dir(path, rank, key)), max_chain)
            if write is not None:
                writers.append(write)
            (mine / key).mkdir(parents=True, exist_ok=True)
            _write_json(mine / key / CHAIN_FILE, {"pieces": [os.path.basename(p) for p in chains[key]]})
    except BaseException:
        shutil.rmtree(mine, ignore_errors=True)
        for pending in writers:
            pending.drop()
        for chain in chains.values():  # the new pieces (last of each chain): no checkpoint names them
            for p in chain[-1:]:
                for f in (p, p + ".npz"):
                    if os.path.exists(f):
                        os.unlink(f)
        raise
    return writers


def read_chain(path: Path, rank: int, key: str) -> List[str]:
    """The pieces (paths, the full one first) of table ``key``'s disk store on ``rank`` that checkpoint ``path``
    needs.

    Raises:
        CheckpointError: the checkpoint names no chain for it, or its chain file is damaged.
    """
    file = path / STORE_FILES_DIR / f"rank{rank}" / key / CHAIN_FILE
    try:
        with open(file) as f:
            names = json.load(f)["pieces"]
        if not isinstance(names, list) or not all(isinstance(n, str) and "/" not in n for n in names):
            raise ValueError("not a list of names")
    except FileNotFoundError:
        # a checkpoint written before chains: a copy of the whole store file in the table's directory (the next
        # checkpoint of a run resumed from it writes a full piece: a chain never refers into another checkpoint)
        legacy = sorted(file.parent.glob("*.rows"))
        if len(legacy) == 1:
            return [str(legacy[0])]
        raise CheckpointError(
            f"checkpoint {path} lacks {file}: it holds no copy of table {key}'s disk store on rank {rank} (a "
            "checkpoint of another configuration, or files lost in a copy); resume from an intact checkpoint"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint {path}: {file} is damaged ({e}); resume from another checkpoint"
        ) from None
    return [str(_pieces_dir(path, rank, key) / n) for n in names]


def collect_pieces(directory: Path) -> int:
    """Remove the pieces under ``directory``/:data:`PIECES_DIR` that no checkpoint in ``directory`` names (and
    partial ones): a deleted checkpoint's pieces go once no kept checkpoint's chain needs them. Nothing is
    removed while a checkpoint's chain file cannot be read. Returns the bytes removed."""
    with _POOL_LOCK:
        return _collect_pieces(directory)


def _collect_pieces(directory: Path) -> int:
    pool = directory / PIECES_DIR
    if not pool.is_dir():
        return 0
    named: Set[Tuple[str, str, str]] = set()
    for file in directory.glob(f"*/{STORE_FILES_DIR}/rank*/*/{CHAIN_FILE}"):
        try:
            with open(file) as f:
                names = json.load(f)["pieces"]
        except (OSError, ValueError, KeyError, TypeError):
            return 0
        rank, key = file.parent.parent.name, file.parent.name
        named.update((rank, key, n) for n in names)
    freed = 0
    for piece in pool.glob("rank*/*/*"):
        name = piece.name[: -len(".npz")] if piece.name.endswith(".npz") else piece.name
        if (piece.parent.parent.name, piece.parent.name, name) in named:
            continue
        try:
            st = piece.stat()
            if piece.name.endswith(".partial") and time.time() - st.st_mtime < _PARTIAL_AGE_S:
                continue  # being written (a background checkpoint); a killed writer's goes later
            piece.unlink()
            freed += st.st_blocks * 512
        except FileNotFoundError:  # renamed into place, or removed, meanwhile
            continue
    return freed


def check_dcp_metadata(path: Path) -> None:
    """Read torch.distributed.checkpoint's ``.metadata`` of the checkpoint directory ``path`` as its loader will,
    before it does: a damaged file is refused here with one error, instead of the loader's two logged warnings
    with tracebacks (global, then rank-local metadata) ahead of its own error.

    Raises:
        CheckpointError: ``.metadata`` cannot be read or unpickled, or holds no checkpoint ``Metadata``.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - unpickling damaged bytes raises many types
        raise CheckpointError(
            f"checkpoint {path}: torch.distributed.checkpoint's .metadata could not be read ({type(e).__name__}: "
            f"{first_line(e, 200)}); the file is damaged, use another checkpoint"
        ) from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"checkpoint {path}: torch.distributed.checkpoint's .metadata holds a {type(metadata).__name__}, not "
            "a checkpoint's Metadata; the file is damaged, use another checkpoint"
        )


def load_meta_file(path: Path) -> Dict[str, Any]:
    """The Lightning part (:data:`META_FILE`) of the checkpoint directory ``path``, as written.

    Raises:
        CheckpointError: the file cannot be read or unpickled, or holds no dict.
    """
    try:
        meta = torch.load(path / META_FILE, weights_only=False)
    except Exception as e:  # noqa: BLE001 - unpickling damaged bytes raises many types
        raise CheckpointError(
            f"checkpoint {path}: {META_FILE} could not be read ({type(e).__name__}); the file is damaged, "
            "use another checkpoint"
        ) from e
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"checkpoint {path}: {META_FILE} holds a {type(meta).__name__}, not the dict TorchRecStrategy writes; "
            "the file is damaged, use another checkpoint"
        )
    return meta


def load_sharded(target: Dict[str, Any], path: Path) -> None:
    """Read the distributed checkpoint ``path`` into ``target`` in place (torch.distributed.checkpoint, every rank).

    Raises:
        CheckpointError: its ``.metadata`` is damaged (checked first, see :func:`check_dcp_metadata`), its shard
            files are damaged or incomplete, or it belongs to another model or configuration (the first line of
            the rank's own error is quoted).
    """
    check_dcp_metadata(path)
    try:
        dcp.load(target, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # CheckpointException derives from BaseException
        failures = getattr(e, "failures", None) or {}
        cause = next(iter(failures.values()), e)  # a CheckpointException holds each rank's own error
        cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, traceback)
        first = first_line(cause)
        if any(
            k in first for k in ("Missing key", "Unexpected key", "size mismatch")
        ):  # intact, of another layout
            raise CheckpointError(
                f"checkpoint {path} holds other tensors than this run's model ({first[:300]}): it was written by "
                "another configuration (cached against resident tables, another store, optimizer or model); resume "
                "it with the config that wrote it, or `python -m torchrec_lookahead export` it into a plain "
                "checkpoint of the model"
            ) from e
        raise CheckpointError(
            f"checkpoint {path} could not be read ({type(cause).__name__}: {first[:300]}): its shard files are "
            "damaged or incomplete (a truncated .distcp file?), or it was written for another model or "
            "configuration; resume from an intact checkpoint of this configuration"
        ) from e


def load_store_files(files: StoreFiles, path: Path, rank: int) -> None:
    """Load this rank's tables kept in files from the chains of pieces checkpoint ``path`` names (see
    :data:`STORE_FILES_DIR` and :data:`PIECES_DIR`).

    Raises:
        CheckpointError: a chain or a piece is missing, damaged, or of another table, shard, layout or seed (the
            piece is named).
    """
    chains = {key: read_chain(path, rank, key) for key in files.stores}
    try:
        files.load(chains)
    except (ConfigError, StoreError) as e:
        raise CheckpointError(
            f"checkpoint {path}: the pieces of the disk stores' files it needs could not be loaded "
            f"({first_line(e, 400)}); resume from an intact checkpoint of this configuration"
        ) from e


def read_checkpoint_meta(path: Path, world_size: Optional[int], fitting: bool = False) -> Dict[str, Any]:
    """The Lightning part of the checkpoint directory ``path``, after checking that the directory is whole,
    was written by as many ranks as this run has (``world_size``; ``None``: not checked) and, to resume training
    from (``fitting``), was saved between training steps (:func:`check_between_steps`).

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
    check_not_inside_checkpoint(path)
    if path.is_file():
        raise CheckpointError(
            f"{path} is a checkpoint file, not a directory written by TorchRecStrategy: an ordinary checkpoint "
            "(of `export`, or of the resident model trained with strategy='auto') is read by the plain model; "
            "run with --trainer.strategy=auto (in Python, Trainer(strategy='auto')) to evaluate or serve it"
        )
    if not (path / META_FILE).is_file() and (
        (path / ".metadata").is_file() or (path / STORE_FILES_DIR).is_dir()
    ):
        raise CheckpointError(
            f"checkpoint {path} is incomplete: its {META_FILE}, written last, is missing (the process was killed, "
            "or the writing failed, while the checkpoint was being written); resume from another checkpoint"
        )
    if not (path / META_FILE).is_file():
        held = sorted((p for p in path.iterdir() if p.suffix == ".ckpt"), key=lambda p: p.stat().st_mtime)
        if held:
            raise CheckpointError(
                f"{path} is a directory of {len(held)} checkpoint(s) (a ModelCheckpoint dirpath), not one "
                f"checkpoint: pass one of them, e.g. the newest, --ckpt_path {held[-1]}"
            )
        raise CheckpointError(
            f"{path} is not a checkpoint written by TorchRecStrategy (no {META_FILE} inside); checkpoints of "
            "sharded models are directories written by torch.distributed.checkpoint on every rank"
        )
    if not (path / ".metadata").is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: torch.distributed.checkpoint's .metadata file is missing (the save "
            "was interrupted, or files were lost in a copy); resume from another checkpoint"
        )
    meta = load_meta_file(path)
    saved = meta.pop(WORLD_SIZE_KEY, None)
    if saved is not None and world_size is not None and int(saved) != world_size:
        ranks = f"{saved} rank" + ("" if int(saved) == 1 else "s")
        if not fitting:  # validate, test, predict: an export reads on any number of ranks
            raise CheckpointError(
                f"checkpoint {path} was written by {ranks} but this run has {world_size}: its tables are sharded "
                f"for {ranks}; export it to one file (python -m torchrec_lookahead export --ckpt {path} --out "
                "<file>), which the plain model reads on any number of ranks with --trainer.strategy=auto, or run "
                f"with {ranks}"
            )
        raise CheckpointError(
            f"checkpoint {path} was written by {ranks} but this run has {world_size}: each rank's "
            f"data position and cache state belong to a {saved}-rank job; resume it with {ranks} "
            f"(torchrun --nproc_per_node=... and --trainer.devices so that they make {saved}), or start a new run"
        )
    if fitting:
        check_not_weights_only(meta, path)
        check_between_steps(meta, path)
    return meta


def holds_weights_only(meta: Dict[str, Any]) -> bool:
    """Whether ``meta`` is that of a checkpoint of ``ModelCheckpoint(save_weights_only=True)`` (or
    ``trainer.save_checkpoint(weights_only=True)``): it holds no optimizer state; Lightning writes
    ``lr_schedulers`` into every other checkpoint."""
    return "lr_schedulers" not in meta and "loops" in meta


def check_not_weights_only(meta: Dict[str, Any], path: Path) -> None:
    """Refuse to resume training from a weights-only checkpoint (:func:`holds_weights_only`), which the load would
    report as tensors of another configuration (the optimizer state missing).

    Raises:
        CheckpointError: ``meta`` is that of a weights-only checkpoint.
    """
    if holds_weights_only(meta):
        raise CheckpointError(
            f"checkpoint {path} holds the model's weights only (ModelCheckpoint save_weights_only=True), without "
            "the optimizer state fit needs to resume; resume from a checkpoint written without save_weights_only, "
            "or read this one with validate, test or predict --ckpt_path"
        )


def check_not_inside_checkpoint(path: Path) -> None:
    """Refuse a file inside a checkpoint directory of TorchRecStrategy (``meta.pt``, a ``.distcp`` shard) given as
    the checkpoint: the checkpoint is the directory.

    Raises:
        CheckpointError: ``path`` is a file whose directory holds a checkpoint's ``meta.pt`` or ``.metadata``.
    """
    parent = path.parent
    if path.is_file() and ((parent / META_FILE).is_file() or (parent / ".metadata").is_file()):
        raise CheckpointError(
            f"{path} is a file inside the checkpoint directory {parent}: a checkpoint of TorchRecStrategy is the "
            f"whole directory; pass --ckpt_path {parent}"
        )


def check_between_steps(meta: Dict[str, Any], path: Path) -> None:
    """Refuse to resume training from a checkpoint saved inside a training step: after an interrupt (Ctrl-C, with
    Lightning's ``OnExceptionCheckpoint``), between the step's batch being fetched and its optimizer step done.
    Its data position counts that batch as trained, so the resumed run would skip it, and its weights may hold
    part of the step (the embedding optimizers update in the backward).

    Raises:
        CheckpointError: the training loop's batch progress has a batch fetched but not processed.
    """
    loops = meta.get("loops")
    fit_loop = loops.get("fit_loop") if isinstance(loops, dict) else None
    progress = fit_loop.get("epoch_loop.batch_progress") if isinstance(fit_loop, dict) else None
    total = progress.get("total") if isinstance(progress, dict) else None
    if not isinstance(total, dict):
        return
    ready, processed = total.get("ready"), total.get("processed")
    if isinstance(ready, int) and isinstance(processed, int) and processed < ready:
        raise CheckpointError(
            f"checkpoint {path} was saved inside training step {ready} (after an interrupt, e.g. Ctrl-C with "
            "OnExceptionCheckpoint): its data position counts that step's batch as trained and its weights may "
            "hold part of the step; resume from a checkpoint saved between steps (ModelCheckpoint's), and stop "
            "runs with SIGTERM, which ends them between steps"
        )


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
