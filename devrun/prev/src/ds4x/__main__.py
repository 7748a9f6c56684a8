"""``python -m ds4x ...``: the ``ds4x`` console script, for environments where the script is not on PATH."""

import sys

from ds4x.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
