"""``python -m torchrec_lookahead export --ckpt <dir> --out <file> [--config <yaml>]``: a servable checkpoint.

A checkpoint of cached training is a directory written by ``torch.distributed.checkpoint`` on every rank, in
the sharded model's keys: cached tables under ``...embedding_bag_collection.cache.embedding_bags.<table>``
with their optimizer state beside them, resident tables under ``...resident...`` (several ranks) or in the
cache's kernel (one rank), everything under ``DistributedModelParallel``'s wrapper. ``export`` writes one
ordinary Lightning checkpoint file of the *resident* model: every table whole, under the keys the unsharded
LightningModule has, so that ``DLRMModule.load_from_checkpoint(out)`` (or the plain TorchRec model) evaluates
and serves it with no plugin in the loop. Optimizer state is left out (serving needs none; a training job
resumes from the original checkpoint).

Example::

    python -m torchrec_lookahead export --ckpt logs/.../epoch=0-step=300.ckpt --out dlrm.ckpt \\
        --config configs/dlrm_lookahead.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

import torch

from torchrec_lookahead._checks import check_output_file
from torchrec_lookahead._disk_space import free_bytes, out_of_space
from torchrec_lookahead.errors import CheckpointError

__all__ = ["resident_key", "resident_state_dict", "export_checkpoint", "main"]

#: module names the sharded model adds around or inside the resident model's own
WRAPPERS = frozenset({"_dmp_wrapped_module", "module", "cache", "resident"})
#: per-row optimizer state the cache keeps beside each table's weight
_STATE_SUFFIXES = (".momentum1", ".momentum2", ".optimizer_step")


def resident_key(key: str) -> str:
    """The resident model's key for a key of the sharded cached model (wrapper names removed).

    Example:
        >>> resident_key("model._dmp_wrapped_module.sparse_arch.embedding_bag_collection.cache.embedding_bags.t.weight")
        'model.sparse_arch.embedding_bag_collection.embedding_bags.t.weight'
    """
    return ".".join(p for p in key.split(".") if p not in WRAPPERS)


def resident_state_dict(state: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """The resident model's state dict from a cached model's (whole tensors): keys mapped by
    :func:`resident_key`, the cache's optimizer state and iteration counter left out.

    Raises:
        CheckpointError: a tensor is still sharded (gather the checkpoint first), or two keys map to one.
    """
    out: Dict[str, torch.Tensor] = {}
    for key, value in state.items():
        in_table = ".embedding_bags." in key or ".embeddings." in key
        if in_table and key.endswith(_STATE_SUFFIXES) or key.endswith(".optimizer_step"):
            continue
        if not isinstance(value, torch.Tensor):
            continue
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            raise CheckpointError(
                f"{key} is a {type(value).__name__}, not a whole tensor: export reads a checkpoint directory, "
                "which it gathers first"
            )
        new = resident_key(key)
        if new in out:
            raise CheckpointError(f"{key} and another key both map to the resident model's {new}")
        out[new] = value.detach().clone()
    return out


def _free_bytes(path: Path) -> str:
    """The free bytes of ``path``'s file system, formatted, for a message ("unknown" if it cannot be read)."""
    free = free_bytes(path)
    return "unknown" if free is None else f"{free:,}"


def _load_whole(ckpt: Path) -> Dict[str, Any]:
    """A checkpoint as one dict of whole tensors: a TorchRecStrategy directory (gathered), or a file."""
    if ckpt.is_dir():
        meta = ckpt / "meta.pt"
        if not meta.is_file() or not (ckpt / ".metadata").is_file():
            raise CheckpointError(
                f"{ckpt} is not a checkpoint directory written by TorchRecStrategy (it needs meta.pt and "
                ".metadata); pass the directory ModelCheckpoint wrote"
            )
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        from torchrec_lookahead.strategies._checkpoint import check_dcp_metadata, load_meta_file

        full = dict(load_meta_file(ckpt))  # both small files first: the gathering below is the slow part
        check_dcp_metadata(ckpt)
        full_tmp: Optional[BaseException] = None
        free = _free_bytes(Path(tempfile.gettempdir()))  # before: a failed write may hold its bytes a while
        with tempfile.TemporaryDirectory() as tmp:
            whole = Path(tmp) / "whole.pt"
            try:
                dcp_to_torch_save(ckpt, whole)
                data = torch.load(whole, weights_only=False)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - several types on damage
                if not out_of_space(e):
                    first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                    raise CheckpointError(f"cannot read the checkpoint {ckpt}: {first}") from e
                full_tmp = e
        if full_tmp is not None:
            root = tempfile.gettempdir()
            shards = sum(f.stat().st_size for f in ckpt.glob("*.distcp"))
            raise CheckpointError(
                f"cannot export {ckpt}: the temporary directory {root} has no space left to gather its shards "
                f"into one file (about {shards:,} bytes; {free} bytes were free there); the "
                "checkpoint itself was read: free space there, or set TMPDIR to a directory with room"
            ) from full_tmp
        full["state_dict"] = _tables_from_files(ckpt, data["state_dict"])
        return full
    if ckpt.is_file():
        try:
            loaded = torch.load(ckpt, weights_only=False, map_location="cpu")
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot read the checkpoint {ckpt} ({type(e).__name__}: {e})") from e
        if not isinstance(loaded, Mapping):
            raise CheckpointError(
                f"{ckpt} holds a {type(loaded).__name__}, not a Lightning checkpoint (a dict with a state_dict); "
                "pass the checkpoint ModelCheckpoint wrote"
            )
        return dict(loaded)
    raise CheckpointError(f"no checkpoint at {ckpt}")


def _tables_from_files(ckpt: Path, state: Mapping[str, Any]) -> Dict[str, Any]:
    """``state`` with every table the checkpoint keeps in disk store files (a ``<collection>.<table>.store_files``
    entry: its row count) read back in full from every rank's chain of pieces (``stores/rank<r>/<key>/chain.json``,
    the pieces beside the checkpoint), each read into a scratch store file beside the checkpoint."""
    from torchrec_lookahead.modules.checkpoint_files import FILES_KEY
    from torchrec_lookahead.store import DiskStore
    from torchrec_lookahead.store.pieces import open_pieces
    from torchrec_lookahead.strategies._checkpoint import STORE_FILES_DIR, read_chain

    out = dict(state)
    for key in [k for k in state if k.endswith("." + FILES_KEY)]:
        prefix, rows = key[: -len(FILES_KEY)], int(out.pop(key))
        table = ".".join(prefix.split(".")[-3:-1])  # <collection>.<table name>: the chains' sub-directory
        columns: Dict[str, torch.Tensor] = {}
        covered = 0
        for rank_dir in sorted(ckpt.glob(f"{STORE_FILES_DIR}/rank*")):
            pieces = read_chain(ckpt, int(rank_dir.name[len("rank") :]), table)
            if not pieces:  # a rank without rows of the table
                continue
            free = _free_bytes(ckpt.parent)  # before: a failed write may hold its bytes a while
            with tempfile.TemporaryDirectory(dir=ckpt.parent, prefix=".export-") as scratch:
                try:
                    store = open_pieces(pieces, scratch)
                except Exception as e:  # noqa: BLE001 - a damaged piece: ConfigError, SetupError, StoreError
                    if out_of_space(e):  # the pieces were read; the scratch file beside them found no room
                        raise CheckpointError(
                            f"cannot export {ckpt}: no space left in {ckpt.parent} for the scratch file that table "
                            f"{table}'s disk store is read into (about {Path(pieces[0]).stat().st_size:,} bytes; "
                            f"{free} bytes were free there): free space there, or copy the checkpoint directory "
                            "with its .store_pieces to a disk with room"
                        ) from e
                    raise CheckpointError(f"cannot read the chain of pieces {pieces} of {ckpt}: {e}") from e
                try:
                    lo, hi = store.row_offset, store.row_offset + store.num_embeddings
                    for name, value in {"weight": store.full_weights(), **store.full_states()}.items():
                        column = columns.setdefault(name, torch.empty(rows, value.shape[1]))
                        column[lo:hi] = value
                    covered += hi - lo
                finally:
                    if isinstance(store, DiskStore):
                        store.close()
        if covered != rows:
            raise CheckpointError(
                f"{ckpt}: the pieces of table {table}'s disk store files hold {covered:,} of its {rows:,} rows "
                f"(under {STORE_FILES_DIR}/rank*/{table}/); the checkpoint is incomplete"
            )
        out.update({prefix + name: value for name, value in columns.items()})
    return out


def export_checkpoint(ckpt: Path, out: Path, config: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Write the resident model's checkpoint of ``ckpt`` to ``out`` (see the module docstring).

    Args:
        ckpt: a checkpoint of cached (or resident) training: a TorchRecStrategy directory or a file.
        out: the Lightning checkpoint file to write.
        config: the job's config(s): the state is then loaded, strictly, into the resident model they
            build, so a mismatch is found here rather than when serving.

    Returns:
        A summary: ``out``, ``tensors``, ``parameters``, ``embedding_tables``.

    Raises:
        CheckpointError: the checkpoint is missing or damaged, or does not fit the config's model; ``out`` is a
            directory; the disk of ``out``, or the temporary directory the shards are gathered in, is full.
        ConfigError: a config file is missing or invalid, or ``out`` lies under a file or in a directory that
            cannot be written (checked, like a directory ``out``, before the checkpoint is read).
    """
    ckpt, out = Path(ckpt), Path(out)
    if out.exists() and out.is_dir():
        raise CheckpointError(f"--out {out} is a directory; name the checkpoint file to write")
    check_output_file("--out", str(out))  # under a file, or not writable: before the slow part
    if not ckpt.exists():
        raise CheckpointError(f"no checkpoint at {ckpt}")
    model = _resident_model(config) if config else None  # the arguments first: reading a checkpoint is slow
    data = _load_whole(ckpt)
    if "state_dict" not in data:
        raise CheckpointError(f"{ckpt} holds no state_dict (is it a Lightning checkpoint?)")
    state = resident_state_dict(data["state_dict"])
    if model is not None:
        try:
            model.load_state_dict(dict(state), strict=True)
        except RuntimeError as e:  # torch's report: a heading and one indented line per kind of difference
            lines = [line.strip() for line in str(e).splitlines()]
            report = "; ".join(line.rstrip(". ") for line in lines[1:] if line) or str(e)
            raise CheckpointError(
                f"the checkpoint {ckpt} does not fit the resident model of the config(s) {list(config or [])}: "
                f"{report}; export it with the config that trained it"
            ) from e
    exported = {k: v for k, v in data.items() if k not in ("state_dict", "optimizer_states", "lr_schedulers")}
    exported["state_dict"] = state
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    free = _free_bytes(out.parent)  # before: a failed write may hold its bytes a while
    try:
        torch.save(exported, tmp)
        tmp.replace(out)  # nothing half-written at ``out``
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # nor beside it (a full disk, an interrupt)
        if isinstance(e, Exception) and out_of_space(e):
            size = sum(v.numel() * v.element_size() for v in state.values())
            raise CheckpointError(
                f"cannot write --out {out}: no space left on its disk (the export holds about {size:,} bytes; "
                f"{free} bytes were free there); nothing was written: free space or choose "
                "another --out"
            ) from e
        raise
    tables = sorted({k.split(".embedding_bags.")[1].split(".")[0] for k in state if ".embedding_bags." in k})
    return {
        "out": str(out),
        "tensors": len(state),
        "parameters": int(sum(v.numel() for v in state.values())),
        "embedding_tables": len(tables),
    }


def _resident_model(config: Sequence[str]) -> torch.nn.Module:
    """The config's LightningModule with its plain, resident model built (no Trainer, no sharding)."""
    from torchrec_lookahead.bundled import resolve_config_args
    from torchrec_lookahead.launch import build_cli

    args = resolve_config_args([a for c in config for a in ("--config", c)]) + ["--trainer.logger=false"]
    lm = build_cli(args).model
    lm.configure_model()
    return lm


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m torchrec_lookahead export``; prints a JSON summary, returns 0."""
    p = argparse.ArgumentParser(
        prog="python -m torchrec_lookahead export", description=__doc__.splitlines()[0]
    )
    p.add_argument("--ckpt", required=True, help="checkpoint of cached training (directory or file)")
    p.add_argument("--out", required=True, help="the resident model's checkpoint file to write")
    p.add_argument("--config", action="append", help="the job's config: check the export against its model")
    args = p.parse_args(argv)
    for flag, value in (("--ckpt", args.ckpt), ("--out", args.out)):
        if not value.strip():  # Path("") is ".", the working directory: an empty shell variable, most likely
            raise CheckpointError(f"{flag} is empty; pass a path (is the shell variable it came from set?)")
    summary = export_checkpoint(Path(args.ckpt), Path(args.out), args.config)
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0
