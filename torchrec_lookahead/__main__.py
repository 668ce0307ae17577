"""``python -m torchrec_lookahead``: see :mod:`torchrec_lookahead.cli`."""

from torchrec_lookahead.cli import main

if __name__ == "__main__":
    main()
