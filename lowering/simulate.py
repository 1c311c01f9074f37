"""The pipeline simulator lives in `ppdsl.schedules.simulate` (see lowering/schedules/): this
name is the very same module."""

import sys

from ppdsl.schedules import simulate as _simulate

sys.modules[__name__] = _simulate
