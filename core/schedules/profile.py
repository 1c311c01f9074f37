"""The cost profile file (``ppdsl tune``'s ``profile.json``, ``pipeline.profile``): what one
process measured on the real model and shapes (``runtime.train.profile``). Plain data, pure Python:
check reads it (dsl/profile_check.py) and lowering splits and times stages on it
(lowering/costs.py); neither imports the other for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

__all__ = ["PROFILE_VERSION", "CommModel", "CostProfile", "Linear", "PartCost"]

PROFILE_VERSION = 1


@attrs.frozen
class Linear:
    """seconds (or bytes) = fixed + per_sample * microbatch size."""

    fixed: float
    per_sample: float

    def at(self, samples: int) -> float:
        return max(0.0, self.fixed + self.per_sample * samples)

    @classmethod
    def fit(cls, s0: int, v0: float, s1: int, v1: float) -> "Linear":
        if s1 == s0:
            return cls(0.0, v0 / s0)
        slope = max(0.0, (v1 - v0) / (s1 - s0))
        return cls(max(0.0, v0 - slope * s0), slope)


@attrs.frozen
class PartCost:
    """One block, or the first / last modules: F, B, W seconds and saved activation bytes."""

    f: Linear
    b: Linear
    w: Linear
    act_bytes: Linear
    params: int


@attrs.frozen
class CommModel:
    """time(bytes) = latency + bytes * per_byte, for p2p (one send/recv pair) and all-reduce
    between two processes; an all-reduce over n is scaled as a ring, 2 (n-1) / n of the bytes."""

    p2p_latency: float
    p2p_per_byte: float
    allreduce_latency: float
    allreduce_per_byte: float

    def p2p(self, nbytes: float) -> float:
        return self.p2p_latency + nbytes * self.p2p_per_byte

    def allreduce(self, nbytes: float, n: int) -> float:
        if n <= 1:
            return 0.0
        # the benchmark's two-process all-reduce moves the bytes once each way: the ring's 2(n-1)/n at n=2
        return (n - 1) * self.allreduce_latency + nbytes * self.allreduce_per_byte * 2 * (n - 1) / n


@attrs.frozen
class CostProfile:
    model: str  # what was profiled, for the reader
    seq_len: int
    samples: tuple[int, int]  # the two microbatch sizes measured
    blocks: tuple[PartCost, ...]
    first: PartCost
    last: PartCost  # head and loss
    boundary_bytes: Linear  # one microbatch's activation between two stages
    optimizer_per_param: float  # seconds per parameter of an optimizer step
    comm: CommModel
    cpus: int  # cores of the machine measured on (CPU oversubscription, docs/tune.md)
    device: str
    # world size -> how much slower the actions of a real run of that many processes were than
    # measured in one process (``ppdsl tune`` calibrates it from one traced run)
    contention: dict[int, float] = attrs.field(factory=dict)
    # tp size -> seconds of one tensor-parallel collective inside F / B, from a traced run
    tp_collective: dict[int, float] = attrs.field(factory=dict)
    # world size -> seconds per step the model does not see (executor, loss all-reduce, data),
    # the calibration run's measured step time minus its prediction
    step_overhead: dict[int, float] = attrs.field(factory=dict)
    # bytes of one weight, gradient or optimizer value at the precision profiled (8 under fp64)
    value_bytes: int = 4

    def slowdown(self, world: int) -> float:
        """The compute slowdown of `world` processes on this machine: calibrated, or on CPU
        without a calibration the share of cores, world / cpus."""
        if world in self.contention:
            return self.contention[world]
        return max(1.0, world / self.cpus) if self.device == "cpu" else 1.0

    def to_json(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, **attrs.asdict(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "CostProfile":
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"cost profile version {d.get('version')!r}, this ppdsl reads {PROFILE_VERSION}")

        def lin(x: dict[str, float]) -> Linear:
            return Linear(float(x["fixed"]), float(x["per_sample"]))

        def part(x: dict[str, Any]) -> PartCost:
            return PartCost(lin(x["f"]), lin(x["b"]), lin(x["w"]), lin(x["act_bytes"]), int(x["params"]))

        return cls(
            model=str(d["model"]), seq_len=int(d["seq_len"]), samples=tuple(d["samples"]),  # type: ignore[arg-type]
            blocks=tuple(part(b) for b in d["blocks"]), first=part(d["first"]), last=part(d["last"]),
            boundary_bytes=lin(d["boundary_bytes"]), optimizer_per_param=float(d["optimizer_per_param"]),
            comm=CommModel(**{k: float(v) for k, v in d["comm"].items()}), cpus=int(d["cpus"]), device=str(d["device"]),
            contention={int(k): float(v) for k, v in d.get("contention", {}).items()},
            tp_collective={int(k): float(v) for k, v in d.get("tp_collective", {}).items()},
            step_overhead={int(k): float(v) for k, v in d.get("step_overhead", {}).items()},
            value_bytes=int(d.get("value_bytes", 4)),
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "CostProfile":
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
