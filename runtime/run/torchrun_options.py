"""torchrun's launcher options that ``ppdsl run`` passes through, in torchrun's spelling (one
table, read by the command line and by the launcher; no torch import here)."""

from __future__ import annotations

from collections.abc import Mapping

import attrs


@attrs.frozen
class LauncherOption:
    """One of torchrun's launcher options that ``ppdsl run`` passes through unchanged."""

    flag: str  # torchrun's spelling, e.g. "--node-rank"
    metavar: str
    help: str
    type: type = str
    extra_names: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """The flag, its underscore alias (as torchrun accepts it) and any extra names."""
        underscore = "--" + self.flag[2:].replace("-", "_")
        return (self.flag, *((underscore,) if underscore != self.flag else ()), *self.extra_names)

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


NPROC = LauncherOption("--nproc", "N", "processes per node (torchrun's --nproc-per-node)", int,
                       ("--nproc-per-node", "--nproc_per_node"))
LAUNCHER_OPTIONS: tuple[LauncherOption, ...] = (
    LauncherOption("--nnodes", "N|MIN:MAX", "number of nodes, or an elastic range MIN:MAX (default 1)"),
    LauncherOption("--node-rank", "R", "this node's rank, for the static rendezvous (--master-addr/--master-port)", int),
    LauncherOption("--rdzv-backend", "NAME", "rendezvous backend: static (default) or c10d"),
    LauncherOption("--rdzv-endpoint", "HOST[:PORT]", "rendezvous endpoint, the same on every node"),
    LauncherOption("--rdzv-id", "ID", "job id, the same on every node"),
    LauncherOption("--rdzv-conf", "K=V,...", "extra rendezvous settings, e.g. join_timeout=900"),
    LauncherOption("--master-addr", "ADDR", "address of node 0 for the static rendezvous"),
    LauncherOption("--master-port", "PORT", "port on node 0 for the static rendezvous", int),
    LauncherOption("--max-restarts", "N", "restart the workers up to N times after a failure; a restarted job "
                   "resumes from the newest complete checkpoint (default 0)", int),
    LauncherOption("--log-dir", "DIR", "torchrun writes each worker's output under DIR"),
    LauncherOption("--redirects", "SPEC", "with --log-dir: which streams go only to the log files "
                   "(0 none, 1 stdout, 2 stderr, 3 both; per rank as 0:1,1:3)"),
    LauncherOption("--local-ranks-filter", "RANKS", "show only these local ranks' output, e.g. 0"),
)
# any of these given: torchrun's own rendezvous instead of --standalone
_RENDEZVOUS_FLAGS = ("--node-rank", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf",
                     "--master-addr", "--master-port")


def parse_nnodes(nnodes: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (torchrun's form) as (min, max); ValueError otherwise."""
    parts = nnodes.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        lo = hi = 0
    if lo < 1 or hi < lo:
        raise ValueError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {nnodes!r}")
    return lo, hi


def is_standalone(options: Mapping[str, str]) -> bool:
    """One node with a local rendezvous: no rendezvous option, at most one node."""
    return not any(f in options for f in _RENDEZVOUS_FLAGS) and parse_nnodes(options.get("--nnodes", "1")) == (1, 1)
