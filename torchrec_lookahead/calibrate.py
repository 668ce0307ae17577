"""``python -m torchrec_lookahead calibrate --config <yaml> [--save PATH] [--json PATH]``: FAE's calibrator.

Reads the config's model and training data, samples the inputs, estimates hot-set sizes with the Rand-Em
Box, picks the threshold whose hot set fits ``hot_budget_bytes`` (the key may sit anywhere in the YAML; the
calibrator's other keys, such as ``sample_fraction``, are read from the same mapping), marks the hot rows and
prints the report. ``--save`` writes the hot set (default: the ``hot_set`` path of a
:class:`~torchrec_lookahead.fae.HotColdDataModule` in the config); ``--json`` writes the figures
(``threshold``, ``hot_budget_bytes``, ``hot_bytes``, ``hot_rows``, ``estimated_hot_rows``,
``hot_access_share``, ``hot_sample_share``, ``seconds``, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Dict, Optional, Sequence

import yaml

from torchrec_lookahead._checks import check_output_file, share_as_created
from torchrec_lookahead.data import WrappedDataModule
from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.fae import (
    CalibrationConfig,
    HotColdDataModule,
    HotSet,
    calibrate,
    calibration_source,
)

__all__ = ["main", "find_mapping", "run_calibration"]

_KEYS = {
    "sample_fraction": "sample_fraction",
    "num_chunks": "num_chunks",
    "chunk_rows": "chunk_rows",
    "box_tolerance": "box_tolerance",
    "box_max_share": "box_max_share",
    "confidence": "confidence",
    "small_table_bytes": "small_table_bytes",
    "calibration_seed": "seed",
}


def find_mapping(tree: Any, key: str) -> Optional[Dict[str, Any]]:
    """The first mapping (depth first) of a parsed YAML tree that holds ``key``.

    Example:
        >>> find_mapping({"data": {"init_args": {"hot_budget_bytes": 8}}}, "hot_budget_bytes")
        {'hot_budget_bytes': 8}
    """
    if isinstance(tree, dict):
        if key in tree:
            return tree
        children = list(tree.values())
    elif isinstance(tree, list):
        children = list(tree)
    else:
        return None
    for child in children:
        found = find_mapping(child, key)
        if found is not None:
            return found
    return None


def _write_atomic(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="calibrate-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        share_as_created(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _refuse_same_file(config: str, save: Optional[str], json_path: Optional[str]) -> None:
    """Refuse outputs that would overwrite the config or each other (before the calibration runs).

    Raises:
        ConfigError: ``--save`` or ``--json`` names the ``--config`` file, or both name one file.
    """
    named = [("--config", config), ("--save", save), ("--json", json_path)]
    seen: Dict[str, str] = {}
    for flag, path in named:
        if path is None:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise ConfigError(f"{flag} {path!r} is the file {seen[real]} names; give each its own file")
        seen[real] = flag


def run_calibration(
    config_path: str, overrides: Sequence[str] = (), save: Optional[str] = None
) -> tuple[HotSet, Optional[str]]:
    """Calibrate the config's training data; returns the hot set and the config's ``hot_set`` path (if any).

    Args:
        config_path: the LightningCLI YAML config.
        overrides: command-line overrides of the config.
        save: where the caller writes the hot set instead of the config's ``hot_set`` path; with ``None``, the
            config's path (if any) is checked before calibrating.

    Raises:
        ConfigError: the config names no ``hot_budget_bytes`` (or a bad value), or the hot set's file cannot
            be written (a directory, say).
    """
    if not os.path.isfile(config_path):
        raise ConfigError(f"Config file not found: {config_path!r}")
    try:
        with open(config_path, encoding="utf-8") as f:
            tree = yaml.safe_load(f)
    except yaml.MarkedYAMLError as e:  # a parse error: where and what
        mark = e.problem_mark
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(
            f"{config_path} is not valid YAML{at}: {e.problem or type(e).__name__}; fix the file"
        ) from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{config_path} is not valid YAML: {type(e).__name__}; fix the file") from None
    holder = find_mapping(tree, "hot_budget_bytes")
    if holder is None:
        raise ConfigError(
            f"{config_path} has no hot_budget_bytes; add one (e.g. data.init_args.hot_budget_bytes: 268435456 under "
            "a torchrec_lookahead.fae.HotColdDataModule)"
        )
    from torchrec_lookahead.launch import build_cli

    cli = build_cli(["--config", config_path, *overrides], run=False)
    dm, model = cli.datamodule, cli.model
    while not isinstance(dm, HotColdDataModule) and isinstance(dm, WrappedDataModule):
        dm = dm.datamodule  # a LookaheadDataModule (pinned hot rows) around the hot/cold DataModule
    if isinstance(dm, HotColdDataModule):
        if save is None and dm.hot_set_path:
            check_output_file("the config's hot_set", dm.hot_set_path)
        return calibrate(
            calibration_source(dm.datamodule), dm.num_embeddings_per_feature, dm.calibration_config(model)
        ), dm.hot_set_path
    kwargs = {ours: holder[theirs] for theirs, ours in _KEYS.items() if theirs in holder}
    cfg = CalibrationConfig(
        hot_budget_bytes=holder["hot_budget_bytes"],
        embedding_dim=int(model.hparams["embedding_dim"]),
        optimizer=str(model.embedding_optimizer.name),
        **kwargs,
    )
    return calibrate(calibration_source(dm), dm.num_embeddings_per_feature, cfg), None  # type: ignore[attr-defined]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m torchrec_lookahead calibrate``; returns the exit status."""
    p = argparse.ArgumentParser(
        prog="python -m torchrec_lookahead calibrate", description=__doc__.splitlines()[0]
    )
    p.add_argument("--config", required=True, help="LightningCLI YAML config with a hot_budget_bytes")
    p.add_argument("--save", default=None, help="where to write the hot set (default: the config's hot_set)")
    p.add_argument("--json", default=None, help="where to write the figures as JSON")
    args, overrides = p.parse_known_args(argv)
    if args.save is not None:  # before the calibration, which takes minutes
        check_output_file("--save", args.save)
    if args.json is not None:
        check_output_file("--json", args.json)
    _refuse_same_file(args.config, args.save, args.json)
    hot_set, configured = run_calibration(args.config, overrides, args.save)
    sys.stdout.write(hot_set.report() + "\n")
    target = args.save or configured
    if target:
        hot_set.save(target)
        sys.stdout.write(f"Hot set saved to {target}\n")
    if args.json:
        _write_atomic(args.json, json.dumps(hot_set.summary(), indent=2) + "\n")
        sys.stdout.write(f"Figures written to {args.json}\n")
    sys.stdout.flush()
    return 0
