"""Turning a profile into a plan: where to cut the layers, how many micro-batches, how much of each
batch the CPU computes, which fine-mode buckets to offload, and how to split the CPU's cores.

The cost model (all times from the profile, scaled by each device's relative speed):

- a stage's time per micro-batch of ``u`` samples is its layers' forward and backward at ``u``
  (the last stage's with the loss's), plus sending its output (and receiving the gradient back)
  over the pipeline link;
- the pipeline's share, cut into ``m`` micro-batches, is played out in the schedule's own order on
  each stage process (``pipeline.schedule_actions``: GPipe, 1F1B, or torch's order of a schedule
  with several stages per process, such as interleaved 1F1B, zero-bubble and DualPipeV, whose
  backward may come in two passes, the input's gradient and the weights', half each): each
  forward after the stage before's and the send between them, each backward after the stage
  after's; a process on the CPU sends with its own thread (gloo), so there a send is its work, on
  a GPU only a delay; every action also costs the stage process the pipelining runtime's own
  time, as measured (``DeviceTimes.action_s``). The time the stage processes wait is the bubble (``(p - 1) / (m + p - 1)``
  for ``p`` equal stages one per process; ``(p - 1) / (V m + p - 1)`` with ``V`` per process in a
  loop). Then the last stage replays the step method on its outputs (the loss's forward once
  more). A process's memory is its stages' parameters, gradients and state with the most
  activations its stages hold at once in that order;
- each CPU worker computes its part of the CPU's share with the whole model and the loss;
- emulated stages compute with the threads the strategy gives them in the layout (all the cores
  the CPU workers leave when those have no share), as much faster as measured with those threads;
- processes that compute on the CPU (the CPU workers, and emulated stages) share its cores: the
  stages' forwards and backwards (in the schedule's order, each after its neighbour's) and the CPU
  workers' shares are played out together, and while the running ones want more threads than
  the cores' worth those processes were measured to get when they all computed at once (fewer
  than the cores where they slow each other down through caches and memory), each runs that much
  slower (``share_cores``);
- the gradient sum costs one all-reduce per stage over the sync link (none when the CPU's share
  is 0: an idle CPU worker does not take part), and the optimizer steps run in parallel (sharing
  the cores in the same way);
- coarse mode adds sum and step after the slower side; fine mode hides them behind the last
  micro-batch's backward, as far as it reaches;
- every step also pays the profile's fixed overhead (the training loop's own work and sharing the
  results), the same for every layout.

Solvers: the partition is a dynamic program over contiguous cuts (into ``p`` or, with several
stages per process, ``V p`` stages) minimizing the slowest stage within each stage's memory (a
process's divided between its stages); the schedule (``schedule="auto"``: every one this torch has,
``schedule_candidates``), stages per process, micro-batch count and the pipeline's share are searched
exhaustively; the offload set is the largest set of buckets a CPU thread can step, in bucket
order, before the backward ends (an exact search over the Pareto front of finish time and bytes),
with more buckets offloaded where the device's memory needs it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_hetero.pipeline import (
    V_SHAPED,
    ZERO_BUBBLE,
    Action,
    available_schedules,
    fallback,
    holders,
    is_multi_stage,
    min_micro_batches,
    resolve_schedule,
    schedule_actions,
    schedule_class,
    schedule_name,
    takes,
)
from lightning_hetero.plan import HeteroPlan
from lightning_hetero.profiling import DeviceTimes, LinkProfile, Profile
from lightning_hetero.shares import largest_divisor_at_most, split_batch
from lightning_hetero.numa import format_cpulist
from lightning_hetero.topology import Topology, threads_for

if TYPE_CHECKING:
    from lightning_hetero.loading import CoreSplit, LoaderTimes

__all__ = [
    "Machine",
    "Prediction",
    "StageCosts",
    "ScheduleChoice",
    "partition",
    "pipeline_tasks",
    "schedule_candidates",
    "Task",
    "share_cores",
    "finish_times",
    "choose_offload",
    "offload_plan",
    "plan_run",
    "plan_replicas",
    "predict_replicas",
    "compare_layouts",
    "predict",
    "predict_plan",
    "step_method_rate",
    "calibrated_optimizer_rates",
    "explain",
    "hypothetical_machine",
    "main",
]

_FREE_LINK = LinkProfile(latency=0.0, bytes_per_s=float("inf"))


@dataclass
class Machine:
    """The devices a plan is for, as roles of the profile scaled by a relative speed."""

    stages: list[str]
    """For each stage, the profile role whose timings it has (e.g. ``"stage0"``) ..."""
    stage_names: list[str]
    """... and the device the plan will name (``"cuda:0"``, ``"cpu"``)."""
    stage_speed: list[float] = field(default_factory=list)
    """Relative speed of each stage's device (1: as profiled)."""
    memory: list[Optional[float]] = field(default_factory=list)
    """Bytes each stage may use (None: unlimited)."""
    cpu_workers: int = 1
    cpu_speed: float = 1.0
    """Relative speed of each CPU worker (1: as profiled)."""
    cpu_threads: Optional[int] = None
    cores: Optional[int] = None
    """Cores the CPU workers and emulated stages share (None: as many as their threads)."""
    shared_cores: dict[str, float] = field(default_factory=dict)
    """The cores' worth they get when they compute at once, as measured (``Profile.shared_cores``);
    absent: ``cores``."""
    stage_threads: list[int] = field(default_factory=list)
    """Threads each emulated stage computes with, where not as profiled."""
    sync: LinkProfile = field(default_factory=lambda: _FREE_LINK)
    """Stage <-> CPU workers: the gradient all-reduce."""
    pipeline: LinkProfile = field(default_factory=lambda: _FREE_LINK)
    """Stage -> stage: activations and their gradients."""
    d2h: LinkProfile = field(default_factory=lambda: _FREE_LINK)
    """Device <-> pinned host memory (offloaded buckets)."""
    action_s: Optional[float] = None
    """What each action of a pipeline schedule costs a stage process beyond its layers (None: as
    profiled, ``DeviceTimes.action_s``)."""

    def __post_init__(self) -> None:
        self.stage_speed = self.stage_speed or [1.0] * len(self.stages)
        self.memory = self.memory or [None] * len(self.stages)

    @classmethod
    def as_profiled(cls, profile: Profile, stage_names: Sequence[str], cpu_workers: int) -> Machine:
        stages = sorted((r for r in profile.devices if r.startswith("stage")), key=lambda r: int(r[5:]))
        return cls(
            stages=stages,
            stage_names=list(stage_names),
            memory=[profile.device_memory.get(r) for r in stages],
            cpu_workers=cpu_workers,
            cores=profile.cpu_cores,
            shared_cores=dict(profile.shared_cores),
            sync=profile.links.get("sync", _FREE_LINK),
            pipeline=profile.links.get("pipeline", _FREE_LINK),
            d2h=profile.links.get("d2h", _FREE_LINK),
        )


@dataclass
class Prediction:
    """What the planner expects of its plan, per optimizer step."""

    step_s: float
    pipeline_s: float
    cpu_s: float
    sync_s: float
    optimizer_s: float
    bubble: float
    memory: list[float]
    """Bytes per stage process (per device for replicas): parameters, gradients, device optimizer state,
    activations in flight."""
    cores_s: float = 0.0
    """The time the pipeline's and the CPU's shares take together on the cores they share
    (``share_cores``); the step's compute takes the longest of this, ``pipeline_s`` and ``cpu_s``."""
    overhead_s: float = 0.0
    """The profile's fixed cost per step, included in ``step_s``."""
    data_s: float = 0.0
    """What waiting for the batch adds to the step (loading it, or the cores the loaders take from
    the compute; ``loading.split_cores``), included in ``step_s``."""
    optimizer_by_role: dict[str, float] = field(default_factory=dict)
    """Per profile role that steps (``"stage0"``, ..., ``"cpu"`` for the CPU workers), when its
    optimizer step ends, the steps sharing the cores; ``optimizer_s`` is the last of them. Stages
    that share a role (a hypothetical machine's GPUs) give the last one's."""

    considered: list[ScheduleChoice] = field(default_factory=list, compare=False)
    """The fastest layout the planner found with each schedule it weighed (``plan_run``), fastest first."""

    def memory_fits(self, memory: Sequence[Optional[float]]) -> bool:
        """Whether every device's bytes fit its memory (``None``: unlimited)."""
        return all(m is None or need <= m for need, m in zip(self.memory, memory))


@dataclass
class ScheduleChoice:
    """A schedule the planner weighed, at the fastest layout it found with it."""

    schedule: str
    stages_per_process: int
    micro_batches: int
    cpu_fraction: float
    step_s: float
    bubble: float
    memory: list[float]
    """Bytes per stage process."""

    def row(self) -> str:
        return (
            f"{self.schedule:<22} {self.stages_per_process:>9} {self.micro_batches:>13} {self.cpu_fraction:>12.3f}"
            f" {self.step_s * 1e3:>10.2f} {self.bubble:>7.0%} {max(self.memory, default=0.0) / 2**20:>12.1f}"
        )

    HEADER = (
        f"{'schedule':<22} {'per proc.':>9} {'micro-batches':>13} {'CPU fraction':>12} {'step ms':>10} {'bubble':>7}"
        f" {'peak MiB':>12}"
    )


@dataclass
class StageCosts:
    """The cost tables one stage's device gives each layer."""

    times: DeviceTimes
    speed: float

    def micro_batch(self, layers: range, samples: float) -> float:
        return self.times.layer_time(layers, samples) / self.speed


def _stage_memory(profile: Profile, layers: Iterable[int], in_flight_samples: float, offloaded_params: int = 0) -> float:
    """Bytes a process holding ``layers`` needs: weights, gradients and optimizer state (a tied weight
    once), and the activations of ``in_flight_samples`` samples."""
    layers = list(layers)
    count, params = profile.held(layers)
    per_param = params / max(1, count)
    # Offloaded buckets count a tied weight in each of its layers: never more than the stage holds.
    state = profile.optimizer_state_factor * (params - min(offloaded_params, count) * per_param)
    activations = sum(profile.layers[i].activation_bytes for i in layers) * in_flight_samples
    return 2 * params + state + activations


INPUT_GRADIENT_SHARE = 0.5
"""Of a backward split in two (the zero-bubble schedules' ``I`` and ``W``), the input gradient's part:
a linear layer's backward is two products of one size, one for its input and one for its weights."""


def _v_shaped(schedule: str) -> bool:
    return schedule_name(schedule_class(schedule)) in V_SHAPED


def _holders(processes: int, stages: int, schedule: str) -> list[int]:
    """The stage process that holds each of ``stages`` stages (``pipeline.holders``)."""
    if stages % processes:
        raise ValueError(f"{stages} stages do not divide between {processes} stage processes.")
    return holders(processes, stages // processes, _v_shaped(schedule))


def _by_stage(machine: Machine, owner: Sequence[int], split_memory: bool = True) -> Machine:
    """The machine with one entry per stage, each its holder's (role, device, speed, threads), and a
    holder's memory divided evenly between its stages (``split_memory``; else each stage may take
    all of it); ``machine`` itself with one stage per process."""
    if list(owner) == list(range(len(machine.stages))):
        return machine
    per = len(owner) // len(machine.stages) if split_memory else 1
    return replace(
        machine,
        stages=[machine.stages[o] for o in owner],
        stage_names=[machine.stage_names[o] for o in owner],
        stage_speed=[machine.stage_speed[o] for o in owner],
        memory=[None if machine.memory[o] is None else machine.memory[o] / per for o in owner],
        stage_threads=[machine.stage_threads[o] for o in owner] if machine.stage_threads else [],
    )


def _held(actions: Sequence[Sequence[Action]], stages: int) -> list[int]:
    """The most micro-batches whose activations each stage holds at once in the schedule's order: from
    its forward until its backward (a split backward's weight pass, which needs them)."""
    peak, now = [0] * stages, [0] * stages
    for order in actions:
        for kind, stage, _ in order:
            if kind == "F":
                now[stage] += 1
                peak[stage] = max(peak[stage], now[stage])
            elif kind in ("B", "W"):
                now[stage] -= 1
    return peak


def _activation_peaks(actions: Sequence[Sequence[Action]], per_micro_batch: Sequence[float]) -> list[float]:
    """Per stage process, the most activation bytes its stages hold at once in the schedule's order
    (``per_micro_batch``: each stage's, for one micro-batch)."""
    peaks = []
    for order in actions:
        now = peak = 0.0
        for kind, stage, _ in order:
            if kind == "F":
                now += per_micro_batch[stage]
                peak = max(peak, now)
            elif kind in ("B", "W"):
                now -= per_micro_batch[stage]
        peaks.append(peak)
    return peaks


def partition(
    profile: Profile,
    machine: Machine,
    micro_batch: float,
    micro_batches: int,
    schedule: str = "GPipe",
    offloadable: bool = False,
    stages_per_process: int = 1,
    first_stage_layers: int = 0,
) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` cuts, one per stage (``stages_per_process`` per stage process, placed
    as the schedule places them), minimizing the slowest stage's time per micro-batch within each
    stage's memory (the activations it holds as the schedule's order keeps them); with ``offloadable``
    (fine mode), a GPU stage's optimizer state need not fit, as it may move to the CPU; the first stage
    holds at least the first ``first_stage_layers`` layers. Raises ``ValueError`` when no cut fits.

    [Note: a process's stages share its memory]
    Where a process holds several stages, the fastest cut with each stage alone within the process's
    memory is taken if the process's stages fit it together (a weight two of them use held once, the
    activations as the schedule's order keeps them: what ``predict`` counts); otherwise the fastest cut
    with each stage within an even part of it, which fits by construction (a shared weight counted in
    each part)."""
    processes = len(machine.stages)
    layers, stages = len(profile.layers), processes * stages_per_process
    if stages > layers:
        raise ValueError(f"Cannot plan {stages} stages for {layers} layers: each stage needs at least one layer.")
    if first_stage_layers > layers - stages + 1:
        raise ValueError(
            f"Cannot plan {stages} stages for {layers} layers with the first {first_stage_layers} in the first stage:"
            " each other stage needs at least one layer."
        )
    owner = _holders(processes, stages, schedule)
    actions = schedule_actions(schedule, processes, stages_per_process, micro_batches)
    held = _held(actions, len(owner))
    whole = _by_stage(machine, owner, split_memory=False)
    for i, layer in enumerate(profile.layers):
        alone = [_need(profile, whole, offloadable, s, range(i, i + 1), micro_batch) for s in range(stages)]
        if all(m is not None and need > m for need, m in zip(alone, whole.memory)):
            largest = max(m for m in whole.memory if m is not None)
            raise ValueError(
                f"Layer {i} ({layer.name}) needs {_gib(min(alone))} with its gradients"
                f"{'' if offloadable else ' and optimizer state'}, more than any stage's memory ({_gib(largest)})."
                " Split it into smaller blocks, or offload its optimizer state in fine mode."
            )
    cut = partial(_cut, profile, micro_batch, held, owner, offloadable, first_stage_layers)
    if stages_per_process == 1:
        return cut(machine)
    bounds = cut(whole, refuse=False)
    if bounds is not None:
        memory = _process_memory(profile, bounds, _process_layers(bounds, owner), actions, micro_batch)
        if _memory_fits(profile, machine, bounds, memory, offloadable, schedule):
            return bounds
    return cut(_by_stage(machine, owner))


def _process_memory(
    profile: Profile,
    bounds: Sequence[tuple[int, int]],
    layers_of: Sequence[Sequence[int]],
    actions: Optional[Sequence[Sequence[Action]]],
    micro_batch: float,
) -> list[float]:
    """Each stage process's bytes (``layers_of``: its layers): weights, gradients and optimizer state (a
    tied weight once), and the most activations of ``micro_batch`` samples its stages hold at once in
    the schedule's order (``actions``; None: no pipeline share, no activations)."""
    peaks = [0.0] * len(layers_of)
    if actions is not None:
        activations = [sum(profile.layers[i].activation_bytes for i in range(*b)) * micro_batch for b in bounds]
        peaks = _activation_peaks(actions, activations)
    return [peak + _stage_memory(profile, layers, 0.0) for peak, layers in zip(peaks, layers_of)]


def _cut(
    profile: Profile,
    micro_batch: float,
    held: Sequence[int],
    owner: Sequence[int],
    offloadable: bool,
    first_stage_layers: int,
    machine: Machine,
    refuse: bool = True,
) -> Optional[list[tuple[int, int]]]:
    """``partition``'s search on a machine of one entry per stage (``_by_stage``): the fastest cut with
    each stage within its entry's memory; None where none fits and not ``refuse``."""
    need = partial(_need, profile, machine, offloadable)
    layers, stages = len(profile.layers), len(machine.stages)
    costs = [StageCosts(profile.devices[role], speed) for role, speed in zip(machine.stages, machine.stage_speed)]
    inf = float("inf")
    best = [[inf] * (layers + 1) for _ in range(stages + 1)]
    cut = [[0] * (layers + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        cost, memory = costs[k - 1], machine.memory[k - 1]
        in_flight = held[k - 1] * micro_batch
        local = k < stages and owner[k - 1] == owner[k]  # the next stage is on the same process: no send
        for i in range(max(k, first_stage_layers) if k == 1 else k, layers - (stages - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf:
                    continue
                span = range(j, i)
                if memory is not None and need(k - 1, span, in_flight) > memory:
                    continue
                send = 0.0 if local else _send(profile, machine, i, micro_batch)
                value = max(best[k - 1][j], cost.micro_batch(span, micro_batch) + send)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    if best[stages][layers] == inf:
        if not refuse:
            return None
        raise ValueError(
            f"No cut of the {layers} layers into {stages} stages fits the stages' memory at micro-batches of"
            f" {micro_batch:g} samples; use more stages, smaller micro-batches, or fine mode's offload."
        )
    bounds, stop = [], layers
    for k in range(stages, 0, -1):
        bounds.append((cut[k][stop], stop))
        stop = cut[k][stop]
    return bounds[::-1]


def _need(profile: Profile, machine: Machine, offloadable: bool, stage: int, span: range, samples: float) -> float:
    """Bytes stage ``stage`` of a machine of one entry per stage needs for the layers of ``span``, with
    ``samples`` samples' activations; with ``offloadable``, a GPU stage's optimizer state may move."""
    offload = offloadable and machine.stage_names[stage].startswith("cuda")
    return _stage_memory(profile, span, samples, profile.held(span)[0] if offload else 0)


def _gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**27 else f"{size / 2**20:.3g} MiB" if size >= 2**17 else f"{size:.0f} bytes"


def _send(profile: Profile, machine: Machine, stop: int, micro_batch: float) -> float:
    """A stage ending before layer ``stop`` sends its output and receives the gradient back."""
    if stop >= len(profile.layers):
        return 0.0
    return 2 * machine.pipeline.time(profile.layers[stop - 1].output_bytes * micro_batch)


def _replay_time(profile: Profile, machine: Machine, samples: int) -> float:
    """The last stage's replay of the step method on the pipeline's ``samples``: the loss's forward,
    and the method's own work. A pipeline of one stage runs the step method itself, with the loss in
    it once (``workers.SoleStage``): only the method's own work is left."""
    sole = len(machine.stages) == 1
    loss = 0.0 if sole else profile.devices[machine.stages[-1]].loss_forward_time(samples) / machine.stage_speed[-1]
    return loss + profile.step_method_s_per_sample * samples if samples else 0.0


def _layout(profile: Profile, machine: Machine, cpu_share: bool) -> tuple[Machine, list[int], Optional[float]]:
    """For a layout with a CPU share or without: the machine with its emulated stages' threads
    (``_stage_threads``), the threads each process computes with on the CPU's cores (the stages',
    then the CPU workers' where they have a share), and the cores' worth those get together."""
    machine = _stage_threads(profile, machine, cpu_share)
    threads = [_threads(profile, machine, s) for s in range(len(machine.stages))]
    if cpu_share:
        threads += [machine.cpu_threads or profile.devices["cpu"].threads] * machine.cpu_workers
    return machine, threads, machine.shared_cores.get("shared" if cpu_share else "stages", machine.cores)


def _on_cpu(device: str) -> bool:
    return device.split(":")[0] == "cpu"


def _threads(profile: Profile, machine: Machine, stage: int) -> int:
    """The threads a stage computes with on the CPU's cores (0 on a GPU): ``stage_threads``, else
    as profiled."""
    if not _on_cpu(machine.stage_names[stage]):
        return 0
    return machine.stage_threads[stage] if machine.stage_threads else profile.devices[machine.stages[stage]].threads


def _stage_threads(profile: Profile, machine: Machine, cpu_share: bool) -> Machine:
    """The machine with its emulated stages' threads as the strategy sets them for a layout
    (``threads_for``): an even split of the cores with the CPU workers, or, where those have no
    share, of the cores alone. Their speed follows their threads as measured (``thread_speedup``)."""
    emulated = [s for s, name in enumerate(machine.stage_names) if _on_cpu(name)]
    if machine.cores is None or not machine.cpu_workers or not emulated:
        return machine
    topology = Topology(cpu_workers=machine.cpu_workers, stage_devices=tuple(torch.device(n) for n in machine.stage_names))
    threads = [
        threads_for(topology.role(machine.cpu_workers + s), topology, machine.cores, cpu_share=cpu_share) if s in emulated else 0
        for s in range(len(machine.stages))
    ]
    speed = [
        v * profile.devices[role].thread_speedup(t) if t else v
        for v, t, role in zip(machine.stage_speed, threads, machine.stages)
    ]
    return replace(machine, stage_speed=speed, stage_threads=threads)


@dataclass
class Task:
    """A stretch of one process's work: ``seconds`` as measured alone, begun once every task in
    ``after`` (``(process, task index, delay)``: that task's end, plus the delay) is over."""

    seconds: float
    after: list[tuple[int, int, float]] = field(default_factory=list)


def share_cores(processes: Sequence[Sequence[Task]], threads: Sequence[int], cores: Optional[float]) -> float:
    """When the last of ``processes`` (each a sequence of tasks run in order) is done, if those
    with ``threads`` on the CPU share ``cores`` of it: while the running processes want more threads
    than that, each runs at that share of its speed alone (and never faster than alone: a process
    cannot use the cores the others leave idle beyond its own threads). Processes without threads
    (driving a GPU) run at their speed alone; with ``cores`` None, every process does."""
    return max(finish_times(processes, threads, cores), default=0.0)


def finish_times(processes: Sequence[Sequence[Task]], threads: Sequence[int], cores: Optional[float]) -> list[float]:
    """When each of ``processes`` is done (0 for one without tasks), played out as ``share_cores``
    describes."""
    done: list[list[float]] = [[] for _ in processes]
    left = [tasks[0].seconds if tasks else 0.0 for tasks in processes]
    now = 0.0
    while True:
        running, starts = [], []
        for i, tasks in enumerate(processes):
            if len(done[i]) == len(tasks):
                continue
            ready = [done[j][k] + delay if k < len(done[j]) else math.inf for j, k, delay in tasks[len(done[i])].after]
            begin = max(ready, default=0.0)
            if begin <= now:
                running.append(i)
            elif begin < math.inf:
                starts.append(begin)
        if not running:
            if not starts:
                break
            now = min(starts)
            continue
        demand = sum(threads[i] for i in running)
        share = cores / demand if cores and demand > cores else 1.0
        speed = {i: share if threads[i] else 1.0 for i in running}
        step = min([left[i] / speed[i] for i in running] + [t - now for t in starts])
        now += step
        for i in running:
            left[i] -= step * speed[i]
            if left[i] <= 1e-12 * (1.0 + processes[i][len(done[i])].seconds):
                done[i].append(now)
                left[i] = processes[i][len(done[i])].seconds if len(done[i]) < len(processes[i]) else 0.0
    if any(len(d) < len(tasks) for d, tasks in zip(done, processes)):
        raise ValueError("The tasks wait for each other in a cycle.")
    return [d[-1] if d else 0.0 for d in done]


def pipeline_tasks(
    profile: Profile, machine: Machine, bounds: Sequence[tuple[int, int]], samples: int, micro_batches: int, schedule: str
) -> list[list[Task]]:
    """Each stage process's work for the pipeline's ``samples`` as tasks (``share_cores``): its stages'
    forwards and backwards (a zero-bubble schedule's input and weight passes apart,
    ``INPUT_GRADIENT_SHARE``) in the schedule's order (``pipeline.schedule_actions``; with more
    ``bounds`` than stage processes, each holds several stages where the schedule places them), each
    after the neighbouring stage's for the same micro-batch and the send between them (none between
    two stages of one process), and the replay on the last stage's process at the end."""
    processes = len(machine.stages)
    if not samples:
        return [[] for _ in range(processes)]
    owner = _holders(processes, len(bounds), schedule)
    staged = _by_stage(machine, owner)
    actions = schedule_actions(schedule, processes, len(bounds) // processes, micro_batches)
    u, last = samples / micro_batches, len(bounds) - 1
    at = {(kind, s, k): (proc, n) for proc, order in enumerate(actions) for n, (kind, s, k) in enumerate(order)}
    sends = [
        machine.pipeline.time(profile.layers[stop - 1].output_bytes * u) if s < last and owner[s] != owner[s + 1] else 0.0
        for s, (_, stop) in enumerate(bounds)
    ]
    costs = [_stage_costs(profile, staged, s, bounds[s], u, s == last) for s in range(len(bounds))]
    # A process on the CPU sends with its own thread (gloo): the send is its work, not a delay.
    sending = [_on_cpu(name) for name in staged.stage_names]
    tasks: list[list[Task]] = []
    for order in actions:
        mine = []
        for kind, s, k in order:
            if kind == "F":
                send = sends[s] if s < last else 0.0
                after = [(*at["F", s - 1, k], 0.0 if sending[s - 1] else sends[s - 1])] if s else []
            elif kind == "W":  # after its own input pass, earlier on this process
                send, after = 0.0, []
            else:
                send = sends[s - 1] if s else 0.0
                if s < last:
                    after = [(*at[("B", s + 1, k) if ("B", s + 1, k) in at else ("I", s + 1, k)], 0.0 if sending[s + 1] else sends[s])]
                else:
                    after = [(*at["F", s, k], 0.0)]
            mine.append(Task(costs[s][kind] + (send if sending[s] else 0.0), after))
        tasks.append(mine)
    tasks[owner[last]].append(Task(_replay_time(profile, staged, samples)))
    return tasks


def _stage_costs(
    profile: Profile, staged: Machine, stage: int, bounds: tuple[int, int], u: float, last: bool
) -> dict[str, float]:
    """A stage's seconds per micro-batch of ``u`` samples, by action kind (``schedule_actions``)."""
    times, speed, span = profile.devices[staged.stages[stage]], staged.stage_speed[stage], range(*bounds)
    loss_forward = times.loss_forward_time(u) if last else 0.0
    loss_backward = times.loss_step_time(u) - loss_forward if last else 0.0
    backward = (times.backward_time(span, u) + loss_backward) / speed
    runtime = times.action_s if staged.action_s is None else staged.action_s
    runtime = runtime if len(staged.stages) > 1 else 0.0  # a pipeline of one stage runs no schedule
    return {
        "F": (times.forward_time(span, u) + loss_forward) / speed + runtime,
        "B": backward + runtime,
        "I": INPUT_GRADIENT_SHARE * backward + runtime,
        "W": (1 - INPUT_GRADIENT_SHARE) * backward + runtime,
    }


def choose_offload(
    ready: Sequence[float], cpu_seconds: Sequence[float], sizes: Sequence[float], backward_end: float
) -> list[int]:
    """The buckets (indices into the lists, in bucket order) whose CPU steps, run one after another
    in bucket order from the moment each bucket is ready, all finish by ``backward_end``, choosing
    the set with the most bytes. Exact: a Pareto front of (finish time, bytes) per prefix."""
    front: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())]
    for k, (at, cost, size) in enumerate(zip(ready, cpu_seconds, sizes)):
        grown = list(front)
        for finish, total, chosen in front:
            end = max(at, finish) + cost
            if end <= backward_end:
                grown.append((end, total + size, (*chosen, k)))
        grown.sort(key=lambda state: (state[0], -state[1]))
        front = []
        for state in grown:  # keep states no other finishes sooner with as many bytes
            if not front or state[1] > front[-1][1]:
                front.append(state)
    return list(max(front, key=lambda state: state[1])[2])


def schedule_candidates(
    schedule: str, stages_per_process: Any, processes: int, layers: int, multi_stage: Optional[Sequence[str]] = None
) -> list[tuple[str, int]]:
    """The schedules (and stages per process) the planner weighs: ``schedule="auto"``, GPipe and 1F1B
    and, with two or more stage processes, the multi-stage schedules ``multi_stage`` names (None: every
    one this torch has; ``stages_per_process="auto"``: 2, 3 and 4 in a loop, 2 in a V; a number: those
    that take it); a schedule by name, that one. None cuts the ``layers`` into more stages than it has."""
    if schedule != "auto":
        name = schedule_name(schedule)
        if stages_per_process != "auto":
            cls = schedule_class(name)
            resolve_schedule(cls, processes, min_micro_batches(cls, processes, stages_per_process), stages_per_process)
        names = [name]
    else:
        names = ["GPipe", "1F1B"] if processes > 1 else ["GPipe"]
        if processes > 1:
            names += available_schedules() if multi_stage is None else available_schedules(multi_stage)
    found = []
    for name in names:
        cls = schedule_class(name)
        if not is_multi_stage(cls):
            counts = [1]
        elif name in V_SHAPED:
            counts = [2]
        else:
            counts = [2, 3, 4]
        if stages_per_process != "auto":
            counts = [c for c in counts if c == stages_per_process] or ([] if schedule == "auto" else [stages_per_process])
        found += [(name, c) for c in counts if processes * c <= layers]
    return found


def plan_run(
    profile: Profile,
    machine: Machine,
    batch_size: int,
    mode: Literal["coarse", "fine"] = "coarse",
    schedule: str = "GPipe",
    max_micro_batches: int = 8,
    bucket_size_mb: float = 25.0,
    stages_per_process: Any = "auto",
    encoder_layers: int = 0,
) -> tuple[HeteroPlan, Prediction]:
    """The fastest layout the cost model finds for ``batch_size`` samples per step, with the schedule
    named, or (``schedule="auto"``) with the fastest of those ``schedule_candidates`` weighs: the cut,
    the micro-batches, the CPU's share, and in fine mode the offload set. The prediction lists the
    fastest layout of every schedule weighed (``Prediction.considered``).

    ``encoder_layers``: the first layers up to the last that takes in the output of an encoder placed
    on another process. A zero-bubble schedule's split backward gives a stage after the first no
    gradient to send back for it, so with those schedules they stay in the first stage."""
    if len(machine.stages) > len(profile.layers):
        raise ValueError(
            f"A pipeline of {len(machine.stages)} stage processes needs a block each, and the model has"
            f" {len(profile.layers)}: use at most {len(profile.layers)} stages, or replicas."
        )
    wanted = schedule_candidates(schedule, stages_per_process, len(machine.stages), math.inf)
    candidates = [(name, per) for name, per in wanted if len(machine.stages) * per <= len(profile.layers)]
    if not wanted:
        raise ValueError(
            f"No schedule the planner weighs runs `stages_per_process={stages_per_process}` (2 to 4 in a loop, 2 in a V);"
            " name a schedule that takes it, or leave `stages_per_process='auto'`."
        )
    if not candidates:  # a schedule named with more stages than the model has blocks
        per = min(c for _, c in wanted)
        raise ValueError(
            f"Schedule {schedule!r} at {per} stages per process cuts the model into {per * len(machine.stages)} stages"
            f" over {len(machine.stages)} stage processes, and it has {len(profile.layers)} blocks: use a schedule of"
            " one stage per process ('GPipe', '1F1B'), fewer stage processes, or a model of more blocks."
        )
    found = []
    kept_out = False  # a zero-bubble schedule that fits only where the encoders' blocks may leave its first stage
    for name, per in candidates:
        if schedule == "auto" and not _readable(name, len(machine.stages), per):
            continue
        first = encoder_layers if name in ZERO_BUBBLE else 0
        layout = _fastest(profile, machine, batch_size, mode, name, per, max_micro_batches, first)
        if layout is not None:
            found.append((name, per, *layout))
        elif first and _fastest(profile, machine, batch_size, mode, name, per, max_micro_batches) is not None:
            kept_out = True
    if not found and kept_out:
        raise ValueError(
            f"Schedule {schedule!r} splits the backward, so the first {encoder_layers} layers (up to the last that"
            " takes in a placed encoder's output) must stay in the first stage, and no cut that keeps them there"
            " fits. Use a schedule with a whole backward ('Interleaved1F1B', 'LoopedBFS', 'GPipe', '1F1B'),"
            " or leave the encoders 'split'."
        )
    if not found:
        raise ValueError("No layout fits: every cut of the layers exceeds some stage's memory.")
    found.sort(key=lambda f: f[-1].step_s)  # stable: the simpler schedule where two tie
    name, per, bounds, pipeline_samples, m, prediction = found[0]
    prediction.considered = [
        ScheduleChoice(n, k, mb, 1 - samples / batch_size, p.step_s, p.bubble, p.memory) for n, k, _, samples, mb, p in found
    ]
    offload: list[int] = []
    if mode == "fine":
        u = pipeline_samples / m if pipeline_samples else 0.0
        offload = offload_plan(profile, machine, bounds, u, bucket_size_mb, name)
    layout = dict(
        boundaries=[start for start, _ in bounds[1:]], micro_batches=m, schedule=name, stages_per_process=per, offload=offload
    )
    return _plan_of(machine, "pipeline", mode, bucket_size_mb, 1 - pipeline_samples / batch_size, prediction, **layout), prediction


def _readable(schedule: str, processes: int, per_process: int) -> bool:
    """Whether this torch's ``schedule`` gives its order to ``schedule_actions``; where it does not (a
    torch whose schedules read more of their stages), it is left out of the choice, with a warning."""
    cls = schedule_class(schedule)
    try:
        schedule_actions(cls, processes, per_process, min_micro_batches(cls, processes, per_process))
    except Exception as error:  # noqa: BLE001 - any failure to read the order only drops this candidate
        rank_zero_warn(f"The planner leaves schedule {schedule!r} out: its order could not be read ({error!r}).")
        return False
    return True


def _fastest(
    profile: Profile,
    machine: Machine,
    batch_size: int,
    mode: str,
    schedule: str,
    per_process: int,
    max_micro_batches: int,
    first_stage_layers: int = 0,
) -> Optional[tuple[list[tuple[int, int]], int, int, Prediction]]:
    """With one schedule: (cut, the pipeline's samples, micro-batches, prediction) of the fastest
    layout whose stage processes fit their memory (``partition``), or None."""
    best: Optional[tuple[list[tuple[int, int]], int, int, Prediction]] = None
    processes, cls = len(machine.stages), schedule_class(schedule)
    # A pipeline of one stage runs its share in one pass (`workers.SoleStage`): no micro-batches.
    # A batch too small for the micro-batches the schedule takes runs in its fallback's order
    # (`pipeline.fallback`), with the schedule's fewest micro-batches planned.
    fewest = min_micro_batches(cls, processes, per_process)
    most = 1 if processes * per_process == 1 else min(max_micro_batches, max(batch_size, fewest))
    for m in range(1, most + 1):
        if not takes(cls, processes, per_process, m):
            continue
        try:
            bounds = partition(profile, machine, batch_size / m, m, schedule, mode == "fine", per_process, first_stage_layers)
        except ValueError:
            continue
        # The pipeline's share is a whole number of micro-batches; or the whole batch (an idle CPU).
        shares = range(0, batch_size + 1, m) if machine.cpu_workers else range(batch_size, batch_size + 1)
        for pipeline_samples in sorted({*shares, batch_size}):
            steps = m if pipeline_samples % m == 0 else largest_divisor_at_most(pipeline_samples, m)
            prediction = predict(profile, machine, bounds, batch_size, pipeline_samples, steps, mode, schedule)
            # The cut fits at m micro-batches of batch_size / m; a share that splits into fewer, larger
            # ones (or runs the schedule's fallback, which may hold more of them) must fit too.
            if not _fits(profile, machine, bounds, prediction, mode, schedule):
                continue
            if best is None or prediction.step_s < best[3].step_s - 1e-12:
                best = (bounds, pipeline_samples, m, prediction)
    return best


def _fits(
    profile: Profile, machine: Machine, bounds: Sequence[tuple[int, int]], prediction: Prediction, mode: str, schedule: str
) -> bool:
    """Whether every stage process's predicted bytes fit its memory (``_memory_fits``)."""
    return _memory_fits(profile, machine, bounds, prediction.memory, mode == "fine", schedule)


def _memory_fits(
    profile: Profile,
    machine: Machine,
    bounds: Sequence[tuple[int, int]],
    memory: Sequence[float],
    offloadable: bool,
    schedule: str,
) -> bool:
    """Whether each stage process's ``memory`` (bytes) fits it; with ``offloadable`` (fine mode) a GPU
    stage's optimizer state need not, as it may move to the CPU (``offload_plan``)."""
    movable = [0.0] * len(machine.stages)
    if offloadable:
        held = _process_layers(bounds, _holders(len(machine.stages), len(bounds), schedule))
        for process, layers in enumerate(held):
            if machine.stage_names[process].startswith("cuda"):
                movable[process] = profile.optimizer_state_factor * profile.held(layers)[1]
    return all(m is None or need - moved <= m for need, moved, m in zip(memory, movable, machine.memory))


def _process_layers(bounds: Sequence[tuple[int, int]], owner: Sequence[int]) -> list[list[int]]:
    """Each stage process's layers: those of every stage it holds (``owner``: each stage's process)."""
    held: list[list[int]] = [[] for _ in range(max(owner) + 1)]
    for stage, (start, stop) in enumerate(bounds):
        held[owner[stage]] += range(start, stop)
    return held


def _plan_of(
    machine: Machine,
    parallelism: str,
    mode: str,
    bucket_size_mb: float,
    cpu_fraction: float,
    prediction: Prediction,
    **layout: Any,
) -> HeteroPlan:
    """The plan of a layout the planner chose on ``machine``."""
    return HeteroPlan(
        parallelism=parallelism,  # type: ignore[arg-type]
        mode=mode,  # type: ignore[arg-type]
        stages=list(machine.stage_names),
        cpu_workers=machine.cpu_workers,
        cpu_threads=machine.cpu_threads,
        cpu_fraction=cpu_fraction,
        bucket_size_mb=bucket_size_mb,
        predicted_step_s=prediction.step_s,
        **layout,
    )


def plan_replicas(
    profile: Profile, machine: Machine, batch_size: int, mode: Literal["coarse", "fine"] = "coarse", bucket_size_mb: float = 25.0
) -> tuple[HeteroPlan, Prediction]:
    """The fastest layout of replicas (``parallelism="replicas"``: every device and CPU worker holds
    the whole model) the cost model finds for ``batch_size`` samples per step: the devices' share."""
    shares = range(0, batch_size + 1) if machine.cpu_workers else range(batch_size, batch_size + 1)
    fits = [
        (prediction, samples)
        for samples in shares
        if (prediction := predict_replicas(profile, machine, batch_size, samples, mode)).memory_fits(machine.memory)
    ]
    if not fits:
        raise ValueError("No layout of replicas fits: the whole model exceeds some device's memory.")
    prediction, samples = min(fits, key=lambda fit: fit[0].step_s)
    plan = _plan_of(machine, "replicas", mode, bucket_size_mb, 1 - samples / batch_size, prediction, micro_batches=1, offload=[])
    return plan, prediction


def compare_layouts(
    profile: Profile,
    machine: Machine,
    batch_size: int,
    mode: Literal["coarse", "fine"] = "coarse",
    schedule: str = "GPipe",
    max_micro_batches: int = 8,
    bucket_size_mb: float = 25.0,
    stages_per_process: Any = "auto",
    encoder_layers: int = 0,
    require: Optional[str] = None,
) -> dict[str, tuple[HeteroPlan, Prediction]]:
    """The best plan of each parallelism that fits, by name (``"pipeline"``: ``plan_run``;
    ``"replicas"``: ``plan_replicas``), fastest first. Raises ``ValueError`` where neither fits, or
    where the parallelism ``require`` names does not (with its planner's reason)."""
    found: dict[str, tuple[HeteroPlan, Prediction]] = {}
    errors = []
    pipeline = (schedule, max_micro_batches, bucket_size_mb, stages_per_process, encoder_layers)
    for name, planner in (
        ("pipeline", lambda: plan_run(profile, machine, batch_size, mode, *pipeline)),
        ("replicas", lambda: plan_replicas(profile, machine, batch_size, mode, bucket_size_mb)),
    ):
        try:
            found[name] = planner()
        except ValueError as error:
            if name == require:
                raise
            errors.append(str(error))
    if not found:
        raise ValueError(" ".join(errors))
    return dict(sorted(found.items(), key=lambda item: item[1][1].step_s))


def _cpu_share_time(profile: Profile, machine: Machine, cpu_samples: int) -> float:
    """Each CPU worker's part of the CPU's share, with the whole model, the loss and the step
    method's own work (the slowest worker's: the share split as evenly as samples allow)."""
    per_worker = math.ceil(cpu_samples / machine.cpu_workers)
    cpu = profile.devices["cpu"].layer_time(range(len(profile.layers)), per_worker) / machine.cpu_speed
    return cpu + profile.step_method_s_per_sample * per_worker


def _optimizer_steps(
    profile: Profile,
    machine: Machine,
    device_params: Sequence[int],
    cpu_params: int,
    workers: int,
    threads: Sequence[int],
    capacity: Optional[float],
) -> tuple[float, dict[str, float]]:
    """When the last optimizer step ends, and per profile role when its own does: each device
    steps its ``device_params``, each of ``workers`` CPU workers ``cpu_params`` (the whole model),
    all played out on the shared cores (``finish_times``)."""
    device_steps = [
        n * profile.devices[role].optimizer_s_per_param / speed
        for n, role, speed in zip(device_params, machine.stages, machine.stage_speed)
    ]
    cpu_step = cpu_params * profile.devices["cpu"].optimizer_s_per_param / machine.cpu_speed if workers else 0.0
    steps = finish_times([[Task(t)] for t in device_steps] + [[Task(cpu_step)]] * workers, threads, capacity)
    by_role = dict(zip(machine.stages, steps))
    if workers:
        by_role["cpu"] = steps[-1]
    return max(steps, default=0.0), by_role


def predict_replicas(
    profile: Profile, machine: Machine, batch_size: int, device_samples: int, mode: str = "coarse"
) -> Prediction:
    """The cost model's step time for replicas: each device computes its even part of
    ``device_samples`` with the whole model (``Shares.device_part``), the CPU workers the rest; then
    one sum of the whole model's gradients between the device replicas and the CPU workers with a
    share (one without keeps out), and each of them steps the whole model. The same tables as a pipeline's (``predict``), without stages."""
    cpu_samples = batch_size - device_samples
    share = bool(cpu_samples and machine.cpu_workers)
    machine, threads, capacity = _layout(profile, machine, share)
    everything = range(len(profile.layers))
    count = len(machine.stages)
    parts = [device_samples // count + (1 if i < device_samples % count else 0) for i in range(count)]
    costs = [StageCosts(profile.devices[role], speed) for role, speed in zip(machine.stages, machine.stage_speed)]
    devices = [cost.micro_batch(everything, n) + profile.step_method_s_per_sample * n if n else 0.0 for cost, n in zip(costs, parts)]
    workers = machine.cpu_workers if share else 0
    cpu = _cpu_share_time(profile, machine, cpu_samples) if share else 0.0
    params, model_bytes = profile.held(everything)
    # Every device replica sums (and steps), with a share or not; a CPU worker only with one.
    sync = machine.sync.time(model_bytes) if count + workers > 1 else 0.0
    cores = share_cores([[Task(t)] for t in devices] + [[Task(cpu)]] * workers, threads, capacity)
    optimizer, optimizer_by_role = _optimizer_steps(profile, machine, [params] * count, params, workers, threads, capacity)
    tail = sync + optimizer
    if mode == "fine" and device_samples:
        # Hidden behind the backward, which the devices end with.
        tail = max(0.0, tail - min(cost.times.backward_time(everything, n) / cost.speed for cost, n in zip(costs, parts) if n))
    return Prediction(
        step_s=max([*devices, cpu, cores]) + tail + profile.step_overhead_s,
        pipeline_s=max(devices),
        cpu_s=cpu,
        cores_s=cores,
        sync_s=sync,
        optimizer_s=optimizer,
        optimizer_by_role=optimizer_by_role,
        bubble=0.0,
        memory=[_stage_memory(profile, everything, n) for n in parts],
        overhead_s=profile.step_overhead_s,
    )


def offload_plan(
    profile: Profile,
    machine: Machine,
    bounds: Sequence[tuple[int, int]],
    micro_batch: float,
    bucket_size_mb: float,
    schedule: str = "GPipe",
) -> list[int]:
    """Fine mode's offload set: on each GPU stage, the buckets a CPU thread can step (with their
    copies over the host link) before that stage's last backward ends (``choose_offload``), and
    more, largest first, where the stage's memory cannot hold the rest of their optimizer state.
    A tied weight's bucket is ready when the backward ends. Emulated (CPU) stages gain nothing from
    offloading and offload nothing."""
    cpu = profile.devices.get("cpu")
    chosen: set[int] = set()
    machine = _by_stage(machine, _holders(len(machine.stages), len(bounds), schedule))
    buckets = _buckets(profile, bounds, int(bucket_size_mb * 2**20))
    for s, (role, speed, memory, name) in enumerate(zip(machine.stages, machine.stage_speed, machine.memory, machine.stage_names)):
        if not name.startswith("cuda") or cpu is None:
            continue
        own = [(b, params, nbytes) for b, params, nbytes in buckets if s in b.stages]
        times = profile.devices[role]
        backward = [times.backward_time(range(*b.layers), micro_batch) / speed for b, _, _ in own]
        ready = [sum(backward[: k + 1]) for k in range(len(own))]
        params = [n for _, n, _ in own]
        nbytes = [n for _, _, n in own]
        cost = [n * cpu.offloaded_s_per_param + 2 * machine.d2h.time(b) for n, b in zip(params, nbytes)]
        picked = choose_offload(ready, cost, nbytes, backward_end=sum(backward))
        if memory is not None:
            need = lambda ks: _stage_memory(profile, range(*bounds[s]), micro_batch, sum(params[k] for k in ks))  # noqa: E731
            for k in sorted(set(range(len(own))) - set(picked), key=lambda k: -params[k]):
                if need(picked) <= memory:
                    break
                picked.append(k)
        chosen.update(own[k][0].index for k in picked)
    return sorted(chosen)


def _buckets(profile: Profile, bounds: Sequence[tuple[int, int]], bucket_bytes: int) -> list[tuple[Any, int, int]]:
    """Fine mode's buckets for the cut ``bounds`` (``sync.make_buckets``), each with the parameters and
    bytes it steps, as ``workers.Placement.buckets`` fills them: a weight that layers of several stages
    share has a bucket of its own; one shared within a stage is in the bucket of its earliest use."""
    from lightning_hetero.sync import make_buckets

    stage_of = [s for s, (start, stop) in enumerate(bounds) for _ in range(start, stop)]
    across: dict[tuple[int, ...], list[Any]] = {}
    within = []
    for tied in profile.tied:
        stages = tuple(sorted({stage_of[i] for i in tied.layers}))
        if len(stages) > 1:
            across.setdefault(stages, []).append(tied)
        else:
            within.append(tied)
    buckets = make_buckets([layer.params for layer in profile.layers], bounds, bucket_bytes, list(across))
    home = {id(t): next(k for k, b in enumerate(buckets) if b.layers[0] <= min(t.layers) < b.layers[1]) for t in within}
    sized = []
    for k, b in enumerate(buckets):
        if b.tied:
            sized.append((b, sum(t.params for t in across[b.tied]), sum(t.param_bytes for t in across[b.tied])))
            continue
        span = range(*b.layers)
        params = sum(profile.layers[i].params for i in span)
        nbytes = sum(profile.layers[i].param_bytes for i in span)
        for t in [t for ts in across.values() for t in ts] + within:
            uses = sum(i in span for i in t.layers) - (home.get(id(t)) == k)
            params, nbytes = params - uses * t.params, nbytes - uses * t.param_bytes
        sized.append((b, params, nbytes))
    return sized


def predict_plan(profile: Profile, machine: Machine, plan: HeteroPlan, batch_size: Optional[int] = None) -> Prediction:
    """The cost model's step time for the layout ``plan`` describes (at the profile's batch size
    unless told), as ``plan_run`` (or, for replicas, ``plan_replicas``) predicts it."""
    batch_size = batch_size or profile.batch_size
    if plan.parallelism == "replicas":
        devices = split_batch(batch_size, plan.cpu_fraction, plan.cpu_workers, 1).pipeline_size
        return predict_replicas(profile, machine, batch_size, devices, plan.mode)
    names = [layer.name for layer in profile.layers]
    bounds = plan.cut(names) or partition(
        profile, machine, batch_size / plan.micro_batches, plan.micro_batches, plan.schedule, False, plan.stages_per_process
    )
    shares = split_batch(batch_size, plan.cpu_fraction, plan.cpu_workers, plan.micro_batches)
    steps = shares.micro_batches or plan.micro_batches
    return predict(profile, machine, bounds, batch_size, shares.pipeline_size, steps, plan.mode, plan.schedule)


def predict(
    profile: Profile,
    machine: Machine,
    bounds: Sequence[tuple[int, int]],
    batch_size: int,
    pipeline_samples: int,
    micro_batches: int,
    mode: str = "coarse",
    schedule: str = "GPipe",
) -> Prediction:
    """The cost model's step time for one layout (see the module doc): ``bounds`` cut the blocks into
    stages, one per stage process or (a multi-stage schedule) several, placed as the schedule places
    them. A pipeline's share that splits into fewer micro-batches than the schedule takes runs the
    schedule it falls back to (``pipeline.fallback``), as a run does."""
    processes = len(machine.stages)
    per_process = len(bounds) // processes
    if pipeline_samples:
        schedule = schedule_name(fallback(schedule_class(schedule), processes, per_process, micro_batches))
    owner = _holders(processes, len(bounds), schedule)
    cpu_samples = batch_size - pipeline_samples
    share = bool(cpu_samples and machine.cpu_workers)
    machine, threads, capacity = _layout(profile, machine, share)
    staged = _by_stage(machine, owner)
    cpu = _cpu_share_time(profile, machine, cpu_samples) if share else 0.0
    stage_bytes = [profile.held(range(*b))[1] for b in bounds]
    layers_of = _process_layers(bounds, owner)
    process_params = [profile.held(layers)[0] for layers in layers_of]
    # An idle CPU worker (no share) keeps out of the sum; with a share, it sums with every stage.
    sync = sum(machine.sync.time(n) for n in stage_bytes) if share else 0.0
    workers = machine.cpu_workers if share else 0
    u = pipeline_samples / micro_batches if pipeline_samples else 0.0
    tasks = pipeline_tasks(profile, machine, bounds, pipeline_samples, micro_batches, schedule)
    pipe, bubble = _played_alone(tasks, owner[-1])
    cores = share_cores(tasks + [[Task(cpu)]] * workers, threads, capacity)
    whole_model = profile.held(range(len(profile.layers)))[0]  # what each CPU worker steps
    optimizer, optimizer_by_role = _optimizer_steps(profile, machine, process_params, whole_model, workers, threads, capacity)
    tail = sync + optimizer
    if mode == "fine" and pipeline_samples:
        # Hidden behind the last micro-batch's backward on the stages (all but the first bucket's part).
        window = min(
            StageCosts(profile.devices[role], speed).times.backward_time(range(*b), u) / speed
            for role, speed, b in zip(staged.stages, staged.stage_speed, bounds)
        )
        tail = max(0.0, tail - window)
    actions = schedule_actions(schedule, processes, per_process, micro_batches) if pipeline_samples else None
    memory = _process_memory(profile, bounds, layers_of, actions, u)
    return Prediction(
        step_s=max(pipe, cpu, cores) + tail + profile.step_overhead_s,
        pipeline_s=pipe,
        cpu_s=cpu,
        cores_s=cores,
        sync_s=sync,
        optimizer_s=optimizer,
        optimizer_by_role=optimizer_by_role,
        bubble=bubble,
        memory=memory,
        overhead_s=profile.step_overhead_s,
    )


def _played_alone(tasks: Sequence[Sequence[Task]], replaying: int) -> tuple[float, float]:
    """The pipeline's time with each stage process at its own speed, and its bubble: the share of the
    schedule's time (without the replay, the last task of process ``replaying``) the processes sit
    idle. (The replay waits for nothing but its own process, so one play gives both.)"""
    if not any(tasks):
        return 0.0, 0.0
    schedule = [list(t[:-1]) if r == replaying else list(t) for r, t in enumerate(tasks)]
    ends = finish_times(schedule, [0] * len(schedule), None)
    span = max(ends)
    busy = sum(task.seconds for process in schedule for task in process) / len(schedule)
    ends[replaying] += tasks[replaying][-1].seconds
    return max(ends), (1 - busy / span if span > 0 else 0.0)


def step_method_rate(profile: Profile, machine: Machine, plan: HeteroPlan, replay_s: float, samples: float) -> float:
    """Per sample, the step method's work beyond the model and its loss, from a last stage's replay
    of it on ``samples`` that took ``replay_s`` in the layout ``plan`` describes (the loss's
    forward, at the layout's threads, taken out). A pipeline of one stage runs the whole step
    itself (``workers.SoleStage``): its model's forward and backward and the loss's come out too.
    Where the replay shared the cores with other processes' work, that slowdown stays in: an
    estimate on the safe side."""
    layout, _, _ = _layout(profile, machine, cpu_share=plan.cpu_fraction > 0 and machine.cpu_workers > 0)
    last = plan.stage_holders()[-1]
    times, speed = profile.devices[layout.stages[last]], layout.stage_speed[last]
    if len(layout.stages) == 1 and plan.stages_per_process == 1:
        model = times.layer_time(range(len(profile.layers)), samples)  # the loss's forward and backward with it
        return max(0.0, replay_s - model / speed) / samples
    return max(0.0, replay_s - times.loss_forward_time(samples) / speed) / samples


def calibrated_optimizer_rates(
    profile: Profile, machine: Machine, plan: HeteroPlan, measured: dict[str, float], rounds: int = 20
) -> dict[str, float]:
    """Per profile role, the optimizer's seconds per parameter with which the layout ``plan``
    describes plays each role's optimizer step out (sharing the cores) in the seconds ``measured``
    in the run (role: seconds of one step). The step's speed depends on what the profile cannot
    reproduce on its own, such as how the memory allocator serves the step's temporaries in a
    process that has trained (on 2 cores, 10 ms or 25 ms for the same Adam step), and on how the
    threads help it, which is not how they help the compute. The rates are scaled until each step
    plays out within 0.1% of its time, or for ``rounds``; roles not measured, or without a step in
    the layout, are left out."""
    profile = replace(profile, devices={role: replace(times) for role, times in profile.devices.items()})
    scaled: set[str] = set()
    for _ in range(rounds):
        played = predict_plan(profile, machine, plan).optimizer_by_role
        ratios = {
            role: seconds / played[role]
            for role, seconds in measured.items()
            if role in profile.devices and played.get(role, 0.0) > 0 and seconds > 0
        }
        for role, ratio in ratios.items():
            profile.devices[role].optimizer_s_per_param *= ratio
        scaled |= set(ratios)
        if all(abs(ratio - 1) < 1e-3 for ratio in ratios.values()):
            break
    return {role: profile.devices[role].optimizer_s_per_param for role in sorted(scaled)}


def explain(
    profile: Profile,
    plan: HeteroPlan,
    prediction: Prediction,
    measured_step_s: Optional[float] = None,
    alternative: Optional[tuple[HeteroPlan, Prediction]] = None,
    loading: Optional[tuple[LoaderTimes, CoreSplit]] = None,
    machine: Optional[Machine] = None,
) -> str:
    """A table: per layer, its time on each profiled device and the stage it was placed on;
    then the predicted step (and the measured one, once training has run), and the best layout of
    the other parallelism (``alternative``, from ``compare_layouts``) beside it; and the training
    DataLoader's measured time per batch by worker processes with the split of the cores chosen
    from it (``loading``). ``machine``: a machine the profile was not taken on
    (``hypothetical_machine``); given its cores, they are described instead of the profile's."""
    roles = list(profile.devices)
    names = [layer.name for layer in profile.layers]
    bounds = plan.cut(names) or ([(0, len(names))] if len(plan.stages) * plan.stages_per_process == 1 else [])
    stage_of = {i: s for s, (start, stop) in enumerate(bounds) for i in range(start, stop)}
    owner = plan.stage_holders()
    everywhere = "every device" if plan.parallelism == "replicas" else "-"
    u = profile.batch_size / plan.micro_batches
    header = f"{'layer':<24} {'params':>10} " + " ".join(f"{role + ' ms':>12}" for role in roles) + "  placed on"
    rows = [header, "-" * len(header)]
    last = len(profile.layers) - 1

    def block_time(role: str, i: int) -> float:  # without the loss, which has its own row
        times = profile.devices[role]
        return times.forward_time(range(i, i + 1), u) + times.backward_time(range(i, i + 1), u)

    for i, layer in enumerate(profile.layers):
        times = " ".join(f"{block_time(role, i) * 1e3:12.3f}" for role in roles)
        where = _placed(plan, owner, stage_of[i]) if i in stage_of else everywhere
        rows.append(f"{layer.name[:24]:<24} {layer.params:>10} {times}  {where}")
    if profile.layers:
        times = " ".join(f"{profile.devices[role].loss_step_time(u) * 1e3:12.3f}" for role in roles)
        where = _placed(plan, owner, stage_of[last]) if last in stage_of else everywhere
        rows.append(f"{'(pipeline_loss)':<24} {0:>10} {times}  {where}")
    rows.append("")
    rows.append(
        f"predicted step {prediction.step_s * 1e3:.2f} ms (pipeline {prediction.pipeline_s * 1e3:.2f}, CPU"
        f" {prediction.cpu_s * 1e3:.2f}, both on the shared cores {prediction.cores_s * 1e3:.2f}, sum"
        f" {prediction.sync_s * 1e3:.2f}, optimizer {prediction.optimizer_s * 1e3:.2f},"
        f" fixed {prediction.overhead_s * 1e3:.2f});"
        f" bubble {prediction.bubble:.0%}; CPU fraction {plan.cpu_fraction:.3f}; {plan.micro_batches} micro-batches"
    )
    if plan.parallelism == "replicas":
        rows.append("memory per device: " + ", ".join(f"{m / 2**20:.1f} MiB" for m in prediction.memory))
    else:
        per_process = "" if plan.stages_per_process == 1 else f", {plan.stages_per_process} stages per process"
        rows.append(f"schedule {plan.schedule}{per_process}")
        rows.append("memory per stage process: " + ", ".join(f"{m / 2**20:.1f} MiB" for m in prediction.memory))
    if len(prediction.considered) > 1:
        rows.append("")
        rows.append(
            "each schedule weighed at its fastest layout, as planned from the profile (the bubble: the share of the"
            " schedule the stages wait):"
        )
        rows.append(ScheduleChoice.HEADER)
        rows += [choice.row() for choice in prediction.considered]
        rows.append("")
    if machine is not None and machine.cpu_threads is not None:
        rows.append(
            f"CPU: {machine.cores} cores (as given); {machine.cpu_workers} CPU worker(s) of {machine.cpu_threads}"
            f" thread(s) each, one core kept per stage process (the profile's CPU worker had"
            f" {profile.devices['cpu'].threads})"
        )
    elif profile.numa_nodes:
        rows.append(cpu_workers_line(profile.numa_nodes, plan))
    if loading is not None:
        times, split = loading
        rows.append("")
        rows.append(f"loading a batch (the training DataLoader, {times.batch_size} samples, measured in one process):")
        rows += times.rows()
        rows.append(
            f"the step, waiting for data included, for {split.compute_s * 1e3:.2f} ms of compute ({split.source};"
            f" {split.loading_cores:.2f} cores busy loading at the choice):"
        )
        rows += split.rows()
        shared = "as the topology shares the cores"
        threads = f"per CPU worker {split.cpu_threads or shared}, per emulated stage {split.stage_threads or shared}"
        rows.append(
            f"chosen: {split.dataloader_workers} DataLoader worker(s) per rank; threads {threads};"
            f" waiting for data adds {(split.step_s - split.compute_s) * 1e3:.2f} ms to the step"
        )
    if measured_step_s is not None:
        error = measured_step_s / prediction.step_s - 1
        rows.append(f"measured step {measured_step_s * 1e3:.2f} ms ({error:+.0%} vs predicted)")
    if alternative is not None:
        other, predicted = alternative
        what = "the whole model on every device" if other.parallelism == "replicas" else "the blocks cut into stages"
        rows.append(
            f"parallelism={other.parallelism!r} ({what}): predicted step {predicted.step_s * 1e3:.2f} ms,"
            f" {predicted.step_s / prediction.step_s:.2f}x this plan's, at CPU fraction {other.cpu_fraction:.3f};"
            " memory per device: " + ", ".join(f"{m / 2**20:.1f} MiB" for m in predicted.memory)
        )
    return "\n".join(rows)


def _placed(plan: HeteroPlan, owner: Sequence[int], stage: int) -> str:
    if plan.stages_per_process == 1:
        return f"stage {stage} ({plan.stages[stage]})"
    return f"stage {stage} (process {owner[stage]}: {plan.stages[owner[stage]]})"


def cpu_workers_line(nodes: Sequence[Sequence[int]], plan: HeteroPlan) -> str:
    """What the plan's CPU workers make of the machine's NUMA nodes (``numa.py``), for ``explain.txt``."""
    cores = " | ".join(format_cpulist(node) for node in nodes)
    line = f"CPU: {len(nodes)} NUMA node(s) (cores {cores}); {plan.cpu_workers} CPU worker(s), "
    if plan.cpu_cores:
        line += "pinned to cores " + " | ".join(format_cpulist(c) for c in plan.cpu_cores)
    else:
        line += "not pinned"
        if len(nodes) > 1:
            line += " (cpu_workers='auto' runs one per node, pinned to its cores and memory)"
    if plan.cpu_workers >= 2 or plan.shard_across_nodes:
        line += f"; the optimizer state they hold: {_split_state(plan)}"
    return line


def _split_state(plan: HeteroPlan) -> str:
    """What the CPU workers do with the optimizer state they hold (``sharding.py``)."""
    if not plan.shard_cpu_optimizer:
        return "a whole copy in each (shard_cpu_optimizer=False)"
    between = "every node's CPU workers (shard_across_nodes)" if plan.shard_across_nodes else "them"
    if plan.mode == "coarse":
        return f"split between {between}"
    if plan.offload in ("none", []):
        return "a whole copy in each (fine mode splits offloaded buckets only, and none is offloaded)"
    if plan.offload == "all":
        return f"every bucket offloaded, split between {between}"
    return f"offloaded buckets split between {between}, the others a whole copy in each"


def hypothetical_machine(
    profile: Profile,
    gpus: int,
    gpu_speed: float = 1.0,
    gpu_memory_gb: Optional[float] = None,
    cpu_workers: int = 1,
    cpu_speed: float = 1.0,
    sync_gbps: Optional[float] = None,
    pipeline_gbps: Optional[float] = None,
    host_gbps: Optional[float] = None,
    link_latency_s: Optional[float] = None,
    cpu_cores: Optional[int] = None,
    action_s: Optional[float] = None,
) -> Machine:
    """A machine the profile was not taken on: ``gpus`` stages whose layers run ``gpu_speed`` times as
    fast as the profile's first stage, CPU workers ``cpu_speed`` times as fast as its CPU worker, and
    links of the given bandwidths (GB/s) and latency (otherwise as profiled).

    With ``cpu_cores`` (the machine's cores, all sockets), each stage process keeps one core and the
    CPU workers share the rest; a worker's speed is scaled by its threads over the profiled worker's
    (linear in threads: an upper bound, as memory bandwidth does not grow with cores). ``action_s``:
    what each action of a pipeline schedule costs a stage process beyond its layers (otherwise as
    profiled, which on emulated stages is the cost of gloo on the CPU)."""
    if "stage0" not in profile.devices:
        raise ValueError("The profile has no stage timings ('stage0'); profile a run with at least one stage.")
    if cpu_workers and "cpu" not in profile.devices:
        raise ValueError(
            "The profile has no CPU-worker timings ('cpu'): its run had no CPU worker. Plan without one"
            " (--cpu-workers 0), or profile a run with a CPU worker."
        )
    cpu_threads = None
    if cpu_cores is not None:
        if "cpu" not in profile.devices:
            raise ValueError("The profile has no CPU-worker timings ('cpu'); profile a run with a CPU worker.")
        cpu_threads = max(1, (cpu_cores - gpus) // max(1, cpu_workers))
        cpu_speed *= cpu_threads / profile.devices["cpu"].threads

    def link(name: str, gbps: Optional[float]) -> LinkProfile:
        measured = profile.links.get(name, _FREE_LINK)
        latency = measured.latency if link_latency_s is None else link_latency_s
        return LinkProfile(latency=latency, bytes_per_s=measured.bytes_per_s if gbps is None else gbps * 1e9)

    return Machine(
        stages=["stage0"] * gpus,
        stage_names=[f"cuda:{i}" for i in range(gpus)],
        stage_speed=[gpu_speed] * gpus,
        memory=[gpu_memory_gb * 2**30 if gpu_memory_gb else None] * gpus,
        cpu_workers=cpu_workers,
        cpu_speed=cpu_speed,
        cpu_threads=cpu_threads,
        cores=cpu_cores,
        sync=link("sync", sync_gbps),
        pipeline=link("pipeline", pipeline_gbps),
        d2h=link("d2h", host_gbps),
        action_s=action_s,
    )


def _number(kind: type, least: float, above: bool = False, most: Optional[float] = None) -> Callable[[str], Any]:
    """An option's number of ``kind``, at least ``least`` (``above``: more than it), at most ``most``."""
    import argparse

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, not {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, not {text}")
        if value < least or (above and value == least) or (most is not None and value > most):
            bound = f"more than {least}" if above else f"at least {least}"
            raise argparse.ArgumentTypeError(f"must be {bound}{f' and at most {most}' if most is not None else ''}, not {text}")
        return value

    return parse


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``hetero-plan PROFILE [options]``: plan a run on a machine you may not have yet."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="hetero-plan",
        description="Plan a hetero run from a saved profile (profile.json, written by WorkloadAnalyzer) for a"
        " hypothetical machine, and print the plan, its predicted step time, bubble and memory per device. Given a"
        " multimodal model's encoders.json, place its encoders on that machine (--gpus devices, --cpu-workers).",
    )
    parser.add_argument("profile", help="profile.json written by the WorkloadAnalyzer callback")
    parser.add_argument("--gpus", type=_number(int, 1), default=1, help="GPUs, one pipeline stage each")
    parser.add_argument("--gpu-speed", type=_number(float, 0, above=True), default=1.0, help="each GPU's speed relative to the profiled stage")
    parser.add_argument("--gpu-memory-gb", type=_number(float, 0, above=True), default=None, help="usable memory per GPU")
    parser.add_argument("--cpu-workers", type=_number(int, 0), default=1, help="CPU workers (one per socket is sensible)")
    parser.add_argument("--cpu-speed", type=_number(float, 0, above=True), default=1.0, help="each CPU worker's speed relative to the profiled one")
    parser.add_argument(
        "--cpu-cores", type=_number(int, 1), default=None, help="the machine's cores, all sockets (scales the CPU workers' speed)"
    )
    parser.add_argument("--sync-gbps", type=_number(float, 0, above=True), default=None, help="GPU <-> CPU worker all-reduce bandwidth")
    parser.add_argument("--pipeline-gbps", type=_number(float, 0, above=True), default=None, help="GPU -> GPU bandwidth")
    parser.add_argument("--host-gbps", type=_number(float, 0, above=True), default=None, help="device <-> pinned host memory bandwidth")
    parser.add_argument("--link-latency-us", type=_number(float, 0), default=None, help="latency of every link (default: as profiled)")
    parser.add_argument(
        "--action-us",
        type=_number(float, 0),
        default=None,
        help="what each pipeline schedule action (a stage's forward or backward of a micro-batch, its send's latency"
        " included) costs a GPU's process beyond its layers (default: as profiled)",
    )
    parser.add_argument("--batch-size", type=_number(int, 1), default=None, help="samples per step (default: the profiled batch)")
    parser.add_argument("--mode", choices=["coarse", "fine"], default="coarse")
    parser.add_argument(
        "--schedule",
        default="auto",
        help="a pipeline schedule torch knows (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,"
        " DualPipeV), or auto: the fastest of them",
    )
    parser.add_argument(
        "--stages-per-process",
        default="auto",
        help="stages each GPU holds with a multi-stage schedule (auto: the fastest of 2, 3, 4; 2 in a V)",
    )
    parser.add_argument(
        "--parallelism",
        choices=["pipeline", "replicas", "auto"],
        default="pipeline",
        help="what the GPUs hold: pipeline stages, whole replicas, or whichever is predicted faster (auto)",
    )
    parser.add_argument(
        "--encoder-layers",
        type=_number(int, 0),
        default=0,
        help="a zero-bubble schedule keeps this many first blocks in its first stage: up to the last that holds an"
        " encoder placed on another process (HeteroStrategy(encoders=...)), whose split backward a later stage"
        " could not give a gradient",
    )
    parser.add_argument("--max-micro-batches", type=_number(int, 1), default=8)
    parser.add_argument("--bucket-size-mb", type=_number(float, 0, above=True), default=25.0)
    parser.add_argument("--save", default=None, help="write the plan here (YAML), to replay with HeteroStrategy(plan=...)")
    parser.add_argument(
        "--cpu-fraction", type=_number(float, 0, most=1), default=0.0, help="encoders.json: the CPU workers' share of every batch (default 0)"
    )
    args = parser.parse_args(argv)
    if _names_encoders(args.profile):
        _place_encoders(parser, args)
        return
    try:
        per_process = args.stages_per_process if args.stages_per_process == "auto" else _count(args.stages_per_process)
        if args.schedule != "auto":
            cls = schedule_class(args.schedule)  # a clear error for a name torch does not know
            if per_process != "auto":
                resolve_schedule(cls, args.gpus, min_micro_batches(cls, args.gpus, per_process), per_process)
        profile = Profile.load(args.profile)
        machine = hypothetical_machine(
            profile,
            args.gpus,
            args.gpu_speed,
            args.gpu_memory_gb,
            args.cpu_workers,
            args.cpu_speed,
            args.sync_gbps,
            args.pipeline_gbps,
            args.host_gbps,
            None if args.link_latency_us is None else args.link_latency_us * 1e-6,
            args.cpu_cores,
            None if args.action_us is None else args.action_us * 1e-6,
        )
        batch_size = args.batch_size if args.batch_size is not None else profile.batch_size
        layouts = compare_layouts(
            profile,
            machine,
            batch_size,
            args.mode,
            args.schedule,
            args.max_micro_batches,
            args.bucket_size_mb,
            per_process,
            encoder_layers=args.encoder_layers,
            require=None if args.parallelism == "auto" else args.parallelism,
        )
        chosen = next(iter(layouts)) if args.parallelism == "auto" else args.parallelism
        if chosen not in layouts:
            raise ValueError(f"No layout of {chosen} fits this machine's memory.")
        plan, prediction = layouts.pop(chosen)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    print(plan.table())
    print()
    print(explain(profile, plan, prediction, alternative=next(iter(layouts.values()), None), machine=machine))
    if args.save:
        print(f"\nplan written to {plan.save(args.save)}")


def _count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"--stages-per-process {text}: give a count (1 or more) or auto.")
    return count


def _names_encoders(path: str) -> bool:
    """Whether ``path`` is a multimodal model's encoder profile (``encoders.json``)."""
    try:
        return "places" in json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False


def _place_encoders(parser: Any, args: Any) -> None:
    """``hetero-plan encoders.json``: the best placement of the encoders on the machine the options
    describe, and the fastest others (``encoder_planner``)."""
    from lightning_hetero.encoder_planner import EncoderProfile, best_placement, explain_placement, samples_by_place

    try:
        profile = EncoderProfile.load(args.profile).on(
            args.gpus, args.gpu_speed, args.cpu_workers, args.cpu_speed, args.sync_gbps
        )
        samples = samples_by_place(args.batch_size if args.batch_size is not None else profile.batch_size, args.cpu_fraction, args.cpu_workers, args.gpus)
        best = best_placement(profile.costs(), samples, profile.carrying, split_only=profile.split_only)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    print("encoders: " + (", ".join(f"{m}: {w}" for m, w in best.placement.items()) or "every encoder split"))
    print(f"(HeteroStrategy(encoders={best.placement}), predicted step {best.step_s * 1e3:.3f} ms)")
    print()
    print(explain_placement(profile, samples))


if __name__ == "__main__":
    main()
