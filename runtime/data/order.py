"""The order every file source reads its items in: global sample position ``g`` takes item
``perm_e[g % n]`` of epoch ``e = g // n``, one permutation of the ``n`` items per epoch seeded by
(seed, e) (`runtime.data.source` describes it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ppdsl.runtime.parallel.rng import mix_seed

PERMUTE_MAX = 1 << 24  # up to this many items an epoch's order is a stored permutation; above, an affine map


class _Order:
    """Which of `n` items fills each global sample position: one seeded permutation per epoch."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._cache: dict[int, Any] = {}

    def items(self, positions: Sequence[int]) -> list[int]:
        out = []
        for g in positions:
            epoch, k = divmod(int(g), self.n)
            out.append(self._item(epoch, k))
        return out

    def _item(self, epoch: int, k: int) -> int:
        perm = self._perm(epoch)
        if isinstance(perm, tuple):  # affine: k -> (a * k + b) mod n, a coprime to n
            a, b = perm
            return (a * k + b) % self.n
        return int(perm[k])

    def _perm(self, epoch: int) -> Any:
        if epoch in self._cache:
            return self._cache[epoch]
        import numpy as np

        rng = np.random.default_rng(mix_seed(self.seed, epoch))
        if self.n <= PERMUTE_MAX:
            perm: Any = rng.permutation(self.n)
        else:
            a = int(rng.integers(1, self.n))
            while math.gcd(a, self.n) != 1:
                a = a % (self.n - 1) + 1
            perm = (a, int(rng.integers(0, self.n)))
        if len(self._cache) >= 2:
            self._cache.pop(min(self._cache))
        self._cache[epoch] = perm
        return perm
