"""The machine's NUMA nodes (CPU sockets with their own memory), and the cores each CPU worker takes.

A CPU worker computes at the speed of the memory it reads, and an offloaded optimizer step is bound
by memory bandwidth: a worker whose threads and memory stay on one socket gets that socket's
bandwidth, where one spread over two sockets pays for the link between them. So
``cpu_workers="auto"`` starts one CPU worker per NUMA node this process may run on, each pinned to
its node's cores (``os.sched_setaffinity``; the memory a process touches first lands on its own
node, Linux's default policy) with as many torch threads as it has cores. The nodes are read from
the operating system (``/sys/devices/system/node/node<N>/cpulist``), as ``lscpu`` and ``numactl``
read them, within this process's affinity (``os.sched_getaffinity``: a container or ``taskset`` may
give it fewer cores than the machine has). A node with no cores this process may use (a memory-only
node, or one outside its affinity) holds no worker. On a machine with one node, nothing changes: one
CPU worker, not pinned.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

__all__ = [
    "NumaNode",
    "NODES",
    "numa_nodes",
    "parse_cpulist",
    "format_cpulist",
    "usable_cpus",
    "cpu_worker_cores",
    "check_cpu_cores",
]

NODES = Path("/sys/devices/system/node")
"""Where Linux lists the NUMA nodes."""


@dataclass(frozen=True)
class NumaNode:
    """A NUMA node: its index, and the cores of it this process may run on."""

    index: int
    cpus: tuple[int, ...]


def parse_cpulist(text: str) -> set[int]:
    """Linux's CPU list format (``cpulist`` files, ``taskset -c``): ``"0-3,8,10-11"``; empty for ``""``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if match is None:
            raise ValueError(f"{text!r} is not a CPU list such as '0-3,8,10-11'.")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        cpus.update(range(first, last + 1))
    return cpus


def format_cpulist(cores: Sequence[int]) -> str:
    """Cores as Linux writes them: ``0-3,8``."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def usable_cpus() -> set[int]:
    """The cores this process may run on (its affinity; every core where the OS has none)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def numa_nodes(root: Union[str, Path, None] = None, affinity: Optional[set[int]] = None) -> list[NumaNode]:
    """The NUMA nodes with cores this process may run on (see the module's doc), in index order; one
    node of every usable core where the OS lists none."""
    root = Path(root) if root is not None else NODES
    affinity = usable_cpus() if affinity is None else affinity
    nodes = []
    for path in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])) if root.is_dir() else []:
        cpulist = path / "cpulist"
        if not cpulist.exists():
            continue
        cpus = parse_cpulist(cpulist.read_text()) & affinity
        if cpus:
            nodes.append(NumaNode(int(path.name[4:]), tuple(sorted(cpus))))
    return nodes or [NumaNode(0, tuple(sorted(affinity)))]


def cpu_worker_cores(root: Union[str, Path, None] = None, affinity: Optional[set[int]] = None) -> Optional[list[list[int]]]:
    """``cpu_workers="auto"``: each CPU worker's cores, one worker per NUMA node; ``None`` where there is
    one node (one CPU worker, not pinned)."""
    nodes = numa_nodes(root, affinity)
    return [list(node.cpus) for node in nodes] if len(nodes) > 1 else None


def check_cpu_cores(cores: Any, affinity: Optional[set[int]] = None, here: bool = True) -> list[list[int]]:
    """``cpu_workers`` given as core sets, one per CPU worker, checked: non-empty, disjoint, and (``here``)
    within the cores this process may run on (``affinity``: those, where not this process's)."""
    if isinstance(cores, (str, bytes)) or not isinstance(cores, Sequence) or not cores:
        raise ValueError(f"`cpu_workers={cores!r}` must be a count, 'auto', or a list of core sets (one per CPU worker).")
    sets: list[list[int]] = []
    for cpus in cores:
        if isinstance(cpus, str):
            cpus = sorted(parse_cpulist(cpus))
        if not isinstance(cpus, Sequence) or not cpus or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus):
            raise ValueError(
                f"`cpu_workers={cores!r}`: each CPU worker's cores must be a non-empty list of core numbers (or a CPU"
                " list such as '0-3,8')."
            )
        sets.append(sorted(set(cpus)))
    taken = [c for cpus in sets for c in cpus]
    if len(taken) != len(set(taken)):
        raise ValueError(f"`cpu_workers={cores!r}`: two CPU workers share a core; give each its own cores.")
    affinity = usable_cpus() if affinity is None else affinity
    outside = sorted(set(taken) - affinity) if here else []
    if outside:
        raise ValueError(
            f"`cpu_workers={cores!r}` names cores {outside} this process may not run on (it may use"
            f" {sorted(affinity)}: see `taskset -p {os.getpid()}`)."
        )
    return sets
