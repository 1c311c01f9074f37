"""AST -> Spec: bind names, type values, fill defaults; every file the spec names is looked up
first, in one pass (located.py). One module per job:

- driver.py: the order of the passes; the mesh and the requirements
- located.py: the locate pass (hf_pretrained, profile, data files, tokenizers) and the path
  rules E0410 and E0419
- structure.py: the version, the blocks and keys given
- scope.py: what names mean, numeric values and their derived defaults, cycles
- coerce.py: typed readers (bool, float, choice, call options) every block uses
- model.py, tensor_parallel.py, pipeline.py, train.py, data.py: one block each
"""

from .driver import resolve
from .scope import did_you_mean

__all__ = ["did_you_mean", "resolve"]
