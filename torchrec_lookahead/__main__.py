"""``python -m torchrec_lookahead``: see :mod:`torchrec_lookahead.cli`."""

import sys

if __name__ == "__main__":
    try:  # the libraries take seconds to import: Ctrl-C there is no error of the run's (no import traceback)
        from torchrec_lookahead.cli import main
    except KeyboardInterrupt:
        sys.stderr.write("Interrupted while starting up\n")
        raise SystemExit(130) from None
    main()
