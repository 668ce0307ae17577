"""What every command of the CLI shares: building the :class:`~lightning.pytorch.cli.LightningCLI` over a config,
reporting a :class:`~torchrec_lookahead.errors.LookaheadError` as one line, and ending a multi-rank process.

:mod:`torchrec_lookahead.cli` (``fit``, ``validate``, ``test``, and the dispatch to the other commands),
:mod:`torchrec_lookahead.verify`, :mod:`torchrec_lookahead.export` and :mod:`torchrec_lookahead.calibrate` all
import it, and it imports none of them.

A :class:`LookaheadCLI` runs over any LightningModule whose model holds TorchRec embedding collections (the bundled
:class:`~torchrec_lookahead.models.TorchRecModule` s: DLRM, DCN, DeepFM, or a module of your own) and any
DataModule; where the DataModule exposes ``num_embeddings_per_feature`` and ``num_dense_features`` they are linked
into the model's arguments of those names, so a config names them once. After ``fit`` it prints where the TensorBoard
logs are and the final metrics.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import sys
import traceback
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

import torchrec_lookahead.strategies  # noqa: F401  (registers strategy="torchrec")
from torchrec_lookahead._checks import check_dir
from torchrec_lookahead._log_dirs import refused_run_logs
from torchrec_lookahead._parse_errors import LookaheadArgumentParser, nested_nulls
from torchrec_lookahead._quiet import quiet_evaluation_warnings
from torchrec_lookahead._refusals import (
    full_disk_refused,
    missing_split_files,
    refuse_busy_master_port,
    refuse_unreachable_checkpoints,
    setting_refused,
    turned_off,
)
from torchrec_lookahead.errors import (
    CheckpointError,
    ConfigError,
    LookaheadError,
    first_line,
    peer_gone,
    recent_errors,
)

__all__ = [
    "LookaheadCLI",
    "build_cli",
    "shutdown_distributed",
    "fail_fast_on_error",
    "short_lookahead_errors",
    "find_lookahead_error",
    "TRACEBACK_ENV",
]

TRACEBACK_ENV = "TORCHREC_LOOKAHEAD_TRACEBACK"
"""Set to 1 to see the full traceback of a :class:`~torchrec_lookahead.errors.LookaheadError` from the CLI."""


class LookaheadCLI(LightningCLI):
    """LightningCLI with the data -> model links this project's configs rely on."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments(
            "data.num_embeddings_per_feature",
            "model.init_args.num_embeddings_per_feature",
            apply_on="instantiate",
        )
        parser.link_arguments(
            "data.num_dense_features", "model.init_args.num_dense_features", apply_on="instantiate"
        )

    def _parse_ckpt_path(self) -> None:
        """Lightning's reading of the model's hyperparameters from a ``ckpt_path`` file, a file that is not a
        checkpoint (damaged, or of another kind) refused with a :class:`~torchrec_lookahead.errors.CheckpointError`
        instead of the unpickler's traceback."""
        from pathlib import Path

        from lightning.pytorch.utilities.model_registry import _is_registry

        from torchrec_lookahead.strategies._checkpoint import check_not_inside_checkpoint

        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and str(ckpt_path).startswith("~"):
            # Lightning reads a local path through fsspec, which expands a leading ~: so do the checks below
            ckpt_path = self.config[subcommand]["ckpt_path"] = os.path.expanduser(str(ckpt_path))
        if ckpt_path:
            check_not_inside_checkpoint(Path(str(ckpt_path)))  # before Lightning unpickles a piece of it
            keyword = str(ckpt_path) in ("last", "best", "hpc") or _is_registry(str(ckpt_path))
            if not keyword and "://" not in str(ckpt_path) and not Path(str(ckpt_path)).exists():
                # strategy='auto' (an export evaluated) reached Lightning's FileNotFoundError traceback
                raise CheckpointError(
                    f"checkpoint {ckpt_path} does not exist; check ckpt_path (a checkpoint file, or under "
                    "strategy='torchrec' the directory ModelCheckpoint wrote, e.g. <dirpath>/epoch=0-step=100.ckpt)"
                )
        try:
            with warnings.catch_warnings():
                # a pickle of another kind: torch's note on its protocol would come before the error
                warnings.filterwarnings("ignore", message="Detected pickle protocol")
                super()._parse_ckpt_path()
        except LookaheadError:
            raise
        except Exception as e:  # noqa: BLE001 - unpickling damaged bytes raises many types
            ckpt_path = self.config[self.config["subcommand"]].get("ckpt_path")
            first = first_line(e, 200, sentence=True)
            raise CheckpointError(
                f"cannot read the checkpoint {ckpt_path} ({type(e).__name__}: {first}): the file is damaged or not "
                "a checkpoint; pass one ModelCheckpoint wrote"
            ) from e
        self._refuse_export_for_fit()
        self._check_checkpoint_dir()

    def _refuse_export_for_fit(self) -> None:
        """``fit --ckpt_path <an export>``: an export (:mod:`torchrec_lookahead.export`) holds the loops' progress
        but no optimizer state, and Lightning's restore failed with a ``KeyError`` that blamed
        ``save_weights_only``. Refused before anything is built, with what to do instead."""
        from pathlib import Path

        ckpt_path = self.config["fit"].get("ckpt_path") if self.config.get("subcommand") == "fit" else None
        if not ckpt_path or not Path(str(ckpt_path)).is_file():
            return
        try:
            ckpt = torch.load(str(ckpt_path), weights_only=True, map_location="cpu", mmap=True)
        except Exception:  # noqa: BLE001 - read above; a file torch cannot map is left to Lightning
            return
        if isinstance(ckpt, dict) and "loops" in ckpt and "optimizer_states" not in ckpt:
            raise CheckpointError(
                f"--ckpt_path {ckpt_path} is an export (python -m torchrec_lookahead export): it holds the model's "
                "weights only, no optimizer state, so fit cannot resume from it; resume from the training "
                "checkpoint it was exported from, or evaluate the export with validate/test/predict "
                "--trainer.strategy=auto (or YourModule.load_from_checkpoint) as README.md's export section shows"
            )

    def _check_checkpoint_dir(self) -> None:
        """A ``ckpt_path`` directory (``strategy='torchrec'``'s checkpoints) checked before anything is built, as
        the strategy checks it when it loads it: whole, readable and, for ``fit``, saved between training steps;
        a damaged one is then the run's first line rather than one after the set-up and the sharding."""
        from pathlib import Path

        from torchrec_lookahead.strategies._checkpoint import check_dcp_metadata, read_checkpoint_meta

        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path or not Path(str(ckpt_path)).is_dir():
            return  # none, a file (read above), or "last" / "best" (Lightning finds them later)
        path = Path(str(ckpt_path))
        read_checkpoint_meta(
            path, None, fitting=subcommand == "fit"
        )  # the rank count: checked when it is loaded
        check_dcp_metadata(path)

    def before_instantiate_classes(self) -> None:
        """Refuse a local ``trainer.default_root_dir`` that cannot be a directory to write in (a file, under one, on
        a read-only filesystem or without permission) before anything is built, rather than when the logger first
        writes there."""
        trainer = self._get(self.config, "trainer")
        root = trainer.get("default_root_dir") if trainer is not None else None
        if root is not None and "://" not in str(root):  # a remote one (s3://...) is fsspec's to check
            check_dir("trainer.default_root_dir", root)
        self._refuse_nothing_to_run(trainer)

    def _refuse_nothing_to_run(self, trainer: Any) -> None:
        """``validate``, ``test`` or ``predict`` with its split's ``limit_*_batches`` at 0 would plan the cache and
        exit having run nothing (a config for training often turns validation off), and one whose file-reading
        DataModule has no files for the split would fail once the checkpoint is restored: refused before anything
        is built."""
        subcommand = self.config.get("subcommand")
        split = {"validate": "val", "test": "test", "predict": "predict"}.get(str(subcommand))
        if split is None or trainer is None:
            return
        files = "test" if split == "predict" else split  # predict scores the test split
        missing = missing_split_files(self.config[str(subcommand)].get("data"), files)
        if missing is not None:
            name, key = missing
            also = f" and --trainer.limit_{split}_batches 1.0" if turned_off(trainer, split) else ""
            raise ConfigError(
                f"`{subcommand}` has nothing to run: the config's {name} has no {files}_files; "
                f"pass --{key} <file(s)>{also}"
            )
        limit = trainer.get(f"limit_{split}_batches")
        if turned_off(trainer, split):
            raise ConfigError(
                f"`{subcommand}` has nothing to run: trainer.limit_{split}_batches is {limit} (this config turns "
                f"that split off); pass --trainer.limit_{split}_batches 1.0 to run it"
            )

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        """Lightning's Trainer, its model summary counting embedding tables where they live, its progress bar
        keeping the epoch's length after a mid-epoch resume."""
        from torchrec_lookahead.callbacks import use_embedding_summary, use_resuming_progress_bar

        try:
            trainer = super().instantiate_trainer(**kwargs)
        except RuntimeError as e:  # the same stateful callback twice: Lightning's traceback, our one line
            if "more than one stateful callback" not in str(e):
                raise
            kind = str(e).split("`")[1] if str(e).count("`") >= 2 else "a stateful callback"
            raise ConfigError(
                f"trainer.callbacks has {kind} more than once; a checkpoint keeps one state per such callback: "
                "keep one of them"
            ) from None
        use_embedding_summary(trainer)
        use_resuming_progress_bar(trainer)
        self._agree_across_ranks(trainer)
        self._refuse_unfindable_last(trainer)
        return trainer

    def _refuse_unfindable_last(self, trainer: pl.Trainer) -> None:
        """``fit --ckpt_path=last`` under ``torchrun --max-restarts``, with the last checkpoint written under the
        logger's ``version_N``: a restarted attempt logs to a new version and Lightning finds no last checkpoint
        there, so the attempt silently trains from the start. Refused before anything is built, with the fix."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        if self.subcommand != "fit" or self.config["fit"].get("ckpt_path") != "last":
            return
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) < 1:
            return
        if trainer.logger is None or getattr(trainer.logger, "_version", 0) is not None:
            return  # no logger, or a fixed version: the checkpoints' directory is the same for every attempt
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath is None:
                raise ConfigError(
                    "--ckpt_path=last under torchrun --max-restarts: ModelCheckpoint(save_last=True) has no dirpath, "
                    "so it writes under the logger's version_N, and a restarted attempt (a new version_N) would find "
                    "no last checkpoint and train from the start; give it a fixed directory "
                    "(--trainer.callbacks.dirpath=<dir>, or dirpath: in the config) or the logger a version"
                )

    def _agree_across_ranks(self, trainer: pl.Trainer) -> None:
        """Keep this process's parsed settings: the ``torchrec`` (and ``hierarchical``) strategy compares them
        across the ranks once the process group exists, also in the Trainers ``verify`` builds, and refuses
        ranks given different configs or seeds (:mod:`torchrec_lookahead.strategies._rank_settings`)."""
        from torchrec_lookahead.strategies._rank_settings import flat_settings, remember_settings

        config = self.config[self.subcommand] if self.subcommand else self.config
        remember_settings(flat_settings(config.as_dict()))

    def _summary(self) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        lines: List[str] = []
        if trainer.logger is not None and trainer.logger.log_dir is not None:
            lines.append(f"TensorBoard logs: {trainer.logger.log_dir}")
            lines.append(
                f"  open them with: tensorboard --logdir {shlex.quote(str(trainer.logger.save_dir))}"
            )
        metrics: Dict[str, Any] = {
            k: float(v) for k, v in sorted(trainer.callback_metrics.items()) if isinstance(v, torch.Tensor)
        }
        # cache/<table>/<name>; cache/sync/<name> are the rank's synchronisation totals, not a table's
        per_table = [
            k for k in metrics if k.startswith("cache/") and k.count("/") >= 2 and k.split("/")[1] != "sync"
        ]
        shown = {k: v for k, v in metrics.items() if k not in per_table}
        if shown:
            line = "Final metrics: " + ", ".join(f"{k}={v:.4f}" for k, v in shown.items())
            if per_table:
                line += f" (and {len(per_table)} per-table metrics, cache/<table>/..., in TensorBoard)"
            lines.append(line)
        if lines:
            sys.stdout.write("\n".join(lines) + "\n")
            sys.stdout.flush()

    def fit(self, **kwargs: Any) -> None:
        """``Trainer.fit``; a run refused before its first step (a :class:`~torchrec_lookahead.errors.LookaheadError`
        or Lightning's refusal of a setting) leaves no TensorBoard version of its own that holds only its config
        and hyperparameters (:func:`~torchrec_lookahead._log_dirs.refused_run_logs`)."""
        refuse_busy_master_port(self.trainer)
        if kwargs.get("ckpt_path") == "last":
            refuse_unreachable_checkpoints(self.trainer)
        with refused_run_logs(self.trainer, _refusal), full_disk_refused(self.trainer), setting_refused():
            self.trainer.fit(**kwargs)

    def _evaluate(self, run: Callable[..., Any], **kwargs: Any) -> None:
        """``run`` (``Trainer.validate``, ``test`` or ``predict``), a full disk under its logs one line
        (:func:`full_disk_refused`), Lightning's notes on the callbacks of the checkpoint it reads hidden
        (:mod:`torchrec_lookahead._quiet`)."""
        refuse_busy_master_port(self.trainer)
        with full_disk_refused(self.trainer), quiet_evaluation_warnings():
            run(**kwargs)

    def validate(self, **kwargs: Any) -> None:
        self._evaluate(self.trainer.validate, **kwargs)

    def test(self, **kwargs: Any) -> None:
        self._evaluate(self.trainer.test, **kwargs)

    def predict(self, **kwargs: Any) -> None:
        self._evaluate(self.trainer.predict, **kwargs)

    def after_fit(self) -> None:
        self._summary()

    def after_validate(self) -> None:
        self._summary()

    def after_test(self) -> None:
        self._summary()


def shutdown_distributed(exit_code: Optional[int] = None) -> None:
    """Destroy the process groups before the interpreter exits. With several ranks and ``exit_code`` given,
    also end the process right away (after the atexit handlers and a flush of the standard streams): the
    interpreter's own teardown of gloo's threads after a lookahead run with several ranks was seen to abort
    ("terminate called without an active exception") after all work had finished."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    multi = dist.get_world_size() > 1
    dist.destroy_process_group()
    if multi and exit_code is not None:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


@contextlib.contextmanager
def fail_fast_on_error() -> Iterator[None]:
    """With several ranks, end the process as soon as the wrapped code raises: print the traceback, run the
    atexit handlers (which remove the shared stores), flush the standard streams and exit with status 1.

    A rank that fails must not wait for its peers at exit: a collective left unjoined (a peer stuck in a step's
    all-reduce, or an id all-gather the lookahead planner abandoned) keeps the interpreter's teardown of gloo
    waiting until the peer goes, and the peer waits for this rank, while ``torchrun`` ends the other ranks only
    once one of them has exited.
    """
    import torch.distributed as dist

    try:
        yield
    except BaseException as e:
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            if isinstance(e, SIGTERMException):  # a SystemExit without a code: a stopped run is not a success
                raise SystemExit(1) from None
            raise
        code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
        lost = peer_lost(e, _rank())
        if lost is not None:  # the cause is the other rank's: its error (or torchrun's report) says it
            _end_progress_bar_line()
            sys.stderr.write(lost + "\n")
        elif code and not isinstance(e, SystemExit):
            traceback.print_exc()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


#: what gloo and torch.distributed say when the process at the other end of a collective is gone
def peer_lost(error: BaseException, rank: int = 0) -> Optional[str]:
    """One line for ``error`` when it only says that another rank is gone (a collective whose peer ended: killed,
    or failed with its own error); ``None`` for any other error. The library's message is quoted up to its first
    sentence (gloo's goes on with advice about the remote worker), and a ``rank`` other than 0 prefixes
    ``[rank N]``, as :func:`short_lookahead_errors` does.

    Example:
        >>> line = peer_lost(RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:5431"))
        >>> line.startswith("RuntimeError: [pair.cc:534] Connection closed by peer"), line.endswith("says why)")
        (True, True)
        >>> peer_lost(RuntimeError("Connection reset by peer. This is typically..."), rank=1).split(" (")[0]
        '[rank 1] RuntimeError: Connection reset by peer'
        >>> peer_lost(ValueError("bad")) is None
        True
    """
    if not peer_gone(error):
        return None
    prefix = "" if rank == 0 else f"[rank {rank}] "
    return (
        f"{prefix}{type(error).__name__}: {first_line(error, 200, sentence=True)} (another rank ended: its own "
        "error, or torchrun's report, says why)"
    )


def find_lookahead_error(error: BaseException) -> Optional[LookaheadError]:
    """The :class:`~torchrec_lookahead.errors.LookaheadError` behind ``error``: ``error`` itself, one in its
    chain of causes, or (jsonargparse keeps only the messages of the errors it met while trying a Union's
    subtypes) a recent one whose message ``error``'s text quotes. ``None`` when there is none.

    Example:
        >>> from torchrec_lookahead.errors import ConfigError
        >>> inner = ConfigError("capacity of table 't' must be a positive number of rows but got 0")
        >>> wrapped = ValueError(f"Does not validate against any of the Union subtypes\\n - {inner}")
        >>> type(find_lookahead_error(wrapped)).__name__
        'ConfigError'
    """
    seen = set()
    stack: List[Optional[BaseException]] = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, LookaheadError):
            return e
        stack += [e.__cause__, e.__context__]
    text = str(error)
    for e in reversed(recent_errors()):
        if str(e) and str(e) in text:
            return e
    return None


def _refusal(error: BaseException) -> bool:
    """Whether ``error`` is a refusal the CLI reports as one line (:func:`short_lookahead_errors`)."""
    return find_lookahead_error(error) is not None or isinstance(error, MisconfigurationException)


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _end_progress_bar_line() -> None:
    """End the line of a progress bar left open by the error (Lightning's tqdm bars redraw in place, without a
    newline), so that the error starts a line of its own."""
    tqdm = sys.modules.get("tqdm")
    bars = getattr(getattr(tqdm, "tqdm", None), "_instances", None)
    if bars:
        sys.stderr.write("\n")


@contextlib.contextmanager
def short_lookahead_errors() -> Iterator[None]:
    """Report a :class:`~torchrec_lookahead.errors.LookaheadError` raised inside (also one jsonargparse buried in a
    "Does not validate against any of the Union subtypes" message) as one line, ``<Type>: <message>``, and exit
    with status 1. Every rank reports at once, rank 0 as is and another rank prefixed ``[rank N]``: no rank waits
    for another, so an error of one rank alone is never lost, and an error every rank meets is printed by each
    rank that reaches its report before the launcher ends it (at most once per rank). Other exceptions pass
    unchanged; ``TORCHREC_LOOKAHEAD_TRACEBACK=1`` lets the LookaheadError through too, with its traceback."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        error = find_lookahead_error(e)
        if error is None and isinstance(e, MisconfigurationException):  # Lightning's refusal of a setting
            error = ConfigError(" ".join(line.strip() for line in str(e).splitlines() if line.strip()))
        if error is None or os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        rank = _rank()
        line = f"{type(error).__name__}: {error}\n"
        _end_progress_bar_line()
        sys.stderr.write(line if rank == 0 else f"[rank {rank}] {line}")
        sys.stderr.flush()
        raise SystemExit(1) from None


def build_cli(args: Optional[Sequence[str]], run: bool = False) -> LookaheadCLI:
    """The CLI over ``args`` (``--config ...`` and overrides; ``None``: the command line); with ``run=False`` it
    only instantiates the Trainer, model and DataModule (``cli.trainer``, ``cli.model``, ``cli.datamodule``).

    The model may be any LightningModule whose model holds TorchRec embedding collections (the ``torchrec``
    strategy finds them); the DataModule's ``num_embeddings_per_feature`` and ``num_dense_features`` are passed
    to the model where both have them."""
    with warnings.catch_warnings():
        # The commands hand LightningCLI the command line they parsed (bundled config names resolved, their own
        # options removed): Lightning's warning against passing both args and a command line is about us.
        warnings.filterwarnings("ignore", message=_ARGS_WARNING)
        return LookaheadCLI(
            pl.LightningModule,
            pl.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=None if args is None else nested_nulls(list(args)),
            run=run,
            save_config_kwargs={"overwrite": True},
            parser_class=LookaheadArgumentParser,
        )


_ARGS_WARNING = "LightningCLI's args parameter is intended to run from within Python"
