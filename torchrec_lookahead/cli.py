"""Command line: ``python -m torchrec_lookahead {fit,validate,test,verify,export,calibrate} --config <yaml>``.

``fit``, ``validate``, ``test`` and ``predict`` are Lightning's (a :class:`~torchrec_lookahead.launch.LookaheadCLI`
over any LightningModule whose model holds TorchRec embedding collections: the bundled DLRM, DCN and DeepFM
:class:`~torchrec_lookahead.models.TorchRecModule` s or a module of your own, and any DataModule; batches that
are not TorchRec ``Batch`` es are read through a :class:`~torchrec_lookahead.runtime.BatchAdapter`); ``verify``,
``export`` and ``calibrate`` are this package's. What the commands share (building the CLI, one-line errors,
multi-rank shutdown) is in :mod:`torchrec_lookahead.launch`.
"""

from __future__ import annotations

import sys
from typing import List, Optional

from torchrec_lookahead._quiet import pop_verbose_flag, quiet_known_messages
from torchrec_lookahead.bundled import resolve_config_args
from torchrec_lookahead.launch import (
    build_cli,
    fail_fast_on_error,
    short_lookahead_errors,
    shutdown_distributed,
)

__all__ = ["main"]


def main(args: Optional[List[str]] = None) -> None:
    """Run the CLI (``args`` defaults to ``sys.argv[1:]``); ``verify`` compares cached and resident training,
    ``calibrate`` runs FAE's calibrator (:mod:`torchrec_lookahead.calibrate`). Known-harmless messages of the
    libraries underneath are hidden unless ``--verbose`` is given (:mod:`torchrec_lookahead._quiet`)."""
    argv, verbose = pop_verbose_flag(list(sys.argv[1:] if args is None else args))
    if not verbose:
        quiet_known_messages()
    with short_lookahead_errors():  # `--config NAME` may name a bundled config (torchrec_lookahead.bundled)
        argv = resolve_config_args(argv)
    if argv[:1] == ["verify"]:
        from torchrec_lookahead.verify import main as verify_main

        with fail_fast_on_error(), short_lookahead_errors():
            code = verify_main(argv[1:])
        raise SystemExit(code)
    if argv[:1] == ["export"]:
        from torchrec_lookahead.export import main as export_main

        with short_lookahead_errors():
            code = export_main(argv[1:])
        raise SystemExit(code)
    if argv[:1] == ["calibrate"]:
        from torchrec_lookahead.calibrate import main as calibrate_main

        with short_lookahead_errors():
            code = calibrate_main(argv[1:])
        raise SystemExit(code)
    if argv[:1] in (["-h"], ["--help"]):
        try:
            build_cli(argv, run=True)
        finally:  # LightningCLI prints its subcommands and exits; ours follow
            sys.stdout.write(EXTRA_COMMANDS)
            sys.stdout.flush()
    with fail_fast_on_error(), short_lookahead_errors():
        build_cli(argv, run=True)
    shutdown_distributed(exit_code=0)


EXTRA_COMMANDS = """
torchrec_lookahead commands (beside Lightning's fit, validate, test, predict):
  verify   train a config cached and with every table resident, side by side, and compare (bit-exact by default)
  export   write a cached run's checkpoint as the resident model's, for evaluation and serving
  calibrate  estimate and save a hot set for a hot-embedding budget (FAE)
  each takes --help; --verbose (any command) also shows the libraries' known-harmless warnings
"""
