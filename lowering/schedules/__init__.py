"""The schedule generators live in `ppdsl.schedules` (pure: `ppdsl check` simulates a spec's
schedule, and dsl/ imports nothing of lowering/). This name stays for existing imports and
is the very same modules, not copies."""

import importlib
import sys

for _name in ("ir", "_common", "gpipe", "interleaved", "looped_bfs", "one_f_one_b", "zero_bubble"):
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"ppdsl.schedules.{_name}")
sys.modules[__name__] = importlib.import_module("ppdsl.schedules")
