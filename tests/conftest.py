"""Session-wide test settings, and the fixtures several test modules share.

ppdsl check keeps the facts of every model it builds in the user's cache (dsl/model_facts_cache.py).
The suite never reads or writes the user's: every test process, and every process a test starts,
uses one fresh folder of this session, removed at the end, so no test depends on a cache left by
an earlier run. Tests of the cache itself use their own folder (tests/test_model_facts_cache.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

_SESSION_CACHE = tempfile.mkdtemp(prefix="ppdsl-test-cache-")
os.environ["PPDSL_CACHE_DIR"] = _SESSION_CACHE
os.environ.pop("PPDSL_NO_CACHE", None)


def pytest_unconfigure(config: object) -> None:
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny models: on a busy 2-core machine several OpenMP
    threads only contend (a tiny matmul spins ~100 ms). Restored after the module. Use it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch  # here, not at the top: most test modules run without torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
