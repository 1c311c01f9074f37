"""The shared ground every floor of ppdsl imports: model families, schedules, building a model
from its source, finding files, label rules, the trace file format and shared phrasing.

Nothing here imports dsl/, lowering/ or the CLI, and torch is imported only inside the
functions that build a model. The one exception is each family's torch half
(``core/families/<name>/stage.py``): it is the runtime's adapter for that family, loaded only
by the runtime, and uses runtime types.
"""
