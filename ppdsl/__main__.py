import os
import sys

# `python -m ppdsl` puts the working directory first on sys.path; the `ppdsl` script does not.
# Both find the same model modules (installed packages, then the spec's directory) only without it.
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from .cli import main  # noqa: E402

raise SystemExit(main())
