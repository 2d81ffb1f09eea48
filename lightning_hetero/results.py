"""One step's results, combined across the workers that computed them.

A step's batch is computed in pieces: each CPU worker runs the module's step method on its
share, and the last pipeline stage replays the step method on the pipeline's outputs. What the
step method returns (its loss) and what it passes to ``self.log`` are captured on each of those
ranks, gathered on every rank, combined as if one process had seen the whole batch, and logged
through Lightning on *every* rank. So ``trainer.callback_metrics`` is the same everywhere, and
``ModelCheckpoint``, ``EarlyStopping`` and the loggers see whole-batch values.

Values are combined the way Lightning reduces a logged value over steps: ``mean`` (the default)
is a mean weighted by each worker's sample count, ``sum`` adds, ``max``/``min`` take the extreme.
A ``batch_size`` passed to ``self.log`` is the value's weight instead, except that the size of the
whole batch or of the worker's share (what ``len(batch)`` gives each) stands for the share, and
the loader's batch size passed on a smaller batch (a fixed ``batch_size``, as one process passes
for every batch, the last included) weighs the shares by their samples and the batch by itself. A
``torchmetrics.Metric`` logged as an object keeps its state on each worker; its epoch value is
computed by torchmetrics' cross-process sync, which the strategy routes over gloo.

Values logged from other hooks (``on_train_epoch_end``, callbacks, ...) are each rank's own, as
with DDP; stages before the last never run the step methods, so such hooks see nothing
collected there.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import numbers
import pickle
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection, move_data_to_device
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_hetero.collectives import IN_STEP_METHOD, not_in_a_step_method
from lightning_hetero.mesh import POSTS, REPORTS, LocalMesh, note_not_answered

__all__ = [
    "LoggedValue",
    "WorkerReport",
    "LogCapture",
    "ReportExchange",
    "combine_loss",
    "combine_logs",
    "relog",
    "merge_outputs",
    "sync_metrics_over",
]

_LOG_SIGNATURE = inspect.signature(LightningModule.log)
_LOG_OPTIONS = frozenset(_LOG_SIGNATURE.parameters) - {"self", "name", "value"}
"""The keyword arguments of ``self.log`` after its name and value."""
_NOT_OPTIONS = frozenset({"self", "name", "value", "batch_size", "metric_attribute"})
_REDUCE_NAMES = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}


@dataclass
class LoggedValue:
    """One ``self.log`` call, as plain data that can travel between processes."""

    name: str
    value: float | Tensor | None
    """The logged number; a tensor on its device until the report goes to the host (``WorkerReport.to_host``)."""
    weight: float
    dtype: torch.dtype | None
    options: dict[str, Any]
    metric: str | None = None
    """Module path of a ``torchmetrics.Metric`` logged as an object."""
    share: int | None = None
    """The worker's samples, where ``weight`` is a fixed ``batch_size`` passed to ``self.log`` (the
    loader's, ``LogCapture.nominal``) on a batch of another size."""
    states: tuple[dict[str, Any], ...] = ()
    """For a metric whose batch states merge (``Metric.merge_state``): the state each worker's share
    of the batch gave it (on its device until ``WorkerReport.to_host``, then on the CPU), from which
    every rank computes the whole batch's value."""


@dataclass
class WorkerReport:
    """What one rank computed in one step: its sample count, its loss, its logged values, and
    whether they were finite."""

    samples: int = 0
    loss: float | Tensor | None = None
    """The share's loss: a tensor on its device until ``to_host``, then a number."""
    loss_dtype: torch.dtype | None = None
    logs: list[LoggedValue] = field(default_factory=list)
    pipeline_loss: float | Tensor | None = None
    """A last pipeline stage's loss as its schedule computed it, to check ``loss`` against (``to_host``)."""
    device: dict[str, float] | None = None
    """The rank's process and device stats (``devices.device_stats``), where the run reports them."""
    nonfinite: tuple[str, ...] = ()
    """What of this rank's training step was NaN or Inf: its ``"loss"``, its ``"gradients"`` (``finite.py``)."""
    signals: int = 0
    """The signals this rank noted since its last report, and whether its trainer is to stop
    (``signals.py``), for every rank to act on."""
    extras: dict[str, Any] | None = None
    """The keys besides ``"loss"`` of the dict ``training_step`` returned, on the CPU, where a rank
    that runs the step methods had no share of the batch (``StepEngine.training_step``)."""

    def to_host(self, *extra: Tensor) -> list[float]:
        """Bring what the report still holds on a device to the host, as numbers (its loss, its
        logged values) and CPU tensors (metrics' batch states), with one wait per device, and
        return the numbers of ``extra`` (0-dim tensors). Reading each value where it was logged
        would make the host wait for the device at each ``self.log`` in the forward, before the
        backward is even queued; this waits once, where the step's results are exchanged. Calling
        it again finds nothing left to read."""
        fenced: set[torch.device] = set()

        def to_cpu(tensor: Tensor) -> Tensor:
            if tensor.device.type != "cpu":
                fenced.add(tensor.device)  # the copy is asynchronous: the read below waits for it
            return tensor.to("cpu", non_blocking=True)

        for item in self.logs:
            if item.states:
                item.states = apply_to_collection(item.states, Tensor, to_cpu)
        slots = [(self, "loss"), (self, "pipeline_loss"), *((item, "value") for item in self.logs)]
        held = [(slot, name) for slot, name in slots if isinstance(getattr(slot, name), Tensor)]
        tensors = [getattr(slot, name) for slot, name in held] + list(extra)
        values = _read(tensors, fenced)
        for (slot, name), value in zip(held, values):
            setattr(slot, name, value)
        return values[len(held) :]


def _read(tensors: list[Tensor], fenced: set[torch.device]) -> list[float]:
    """The numbers of 0-dim (one-element) ``tensors``, in float64, one copy per device; a device in
    ``fenced`` with nothing to read is waited for all the same (its asynchronous copies)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(i)
    values = [0.0] * len(tensors)
    for device, indices in by_device.items():
        numbers = torch.stack([tensors[i].detach().reshape(()).double() for i in indices]).cpu().tolist()
        for i, number in zip(indices, numbers):
            values[i] = number
    for device in fenced - set(by_device):
        torch.zeros((), device=device).cpu()
    return values


def _refuse_all_gather(*args: Any, **kwargs: Any) -> Any:
    raise not_in_a_step_method("`self.all_gather`")


class LogCapture:
    """While active, ``module.log`` (and so ``log_dict``) records its calls instead of logging them.

    ``samples`` is the worker's share of a batch of ``batch_size`` samples; ``nominal``: the
    largest batch the step method has run on (the loader's own ``batch_size``, as a fixed
    ``self.log(batch_size=...)`` names it).

    A metric logged as an object carries the state its share gave it (``LoggedValue.states``), for
    every rank to compute the whole batch's value from all the shares' states. A worker whose share
    is the whole batch is the only one to log: its metric's own value is the batch's, and no state
    is noted.
    """

    def __init__(self, module: LightningModule, samples: int, batch_size: int, nominal: int | None = None) -> None:
        self.module = module
        self.samples = samples
        self.batch_size = batch_size
        self.nominal = nominal
        self.logs: list[LoggedValue] = []

    def __enter__(self) -> LogCapture:
        self._in_step_method = IN_STEP_METHOD.set(True)  # the strategy's collectives are refused in it
        self.module.log = self._capture  # type: ignore[method-assign]
        self.module.all_gather = _refuse_all_gather  # type: ignore[method-assign]
        self._batch_states: dict[int, dict[str, Any]] = {}
        shared = 0 < self.samples < self.batch_size
        self._computes = [(m, m.compute) for m in self.module.modules() if isinstance(m, Metric) and _merges(m)] if shared else []
        for metric, compute in self._computes:
            metric.compute = functools.partial(_noting_batch_state, metric, compute, self._batch_states)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        IN_STEP_METHOD.reset(self._in_step_method)
        del self.module.log
        del self.module.all_gather
        for metric, compute in self._computes:
            metric.compute = compute  # type: ignore[method-assign]

    def _capture(self, *args: Any, **kwargs: Any) -> None:
        if len(args) == 2 and kwargs.keys() <= _LOG_OPTIONS:  # `self.log(name, value, option=...)`, as nearly always
            arguments = dict(kwargs, name=args[0], value=args[1])
        else:
            arguments = dict(_LOG_SIGNATURE.bind(self.module, *args, **kwargs).arguments)
        options = {k: v for k, v in arguments.items() if k not in _NOT_OPTIONS}
        name, value = arguments["name"], arguments["value"]
        batch_size = arguments.get("batch_size")
        share = None
        if batch_size is None or batch_size == self.batch_size:  # the whole batch's size stands for the share
            weight = float(self.samples)
        elif batch_size == self.nominal:  # a fixed batch_size on a smaller batch: see `_combine`
            weight, share = float(batch_size), self.samples
        elif batch_size == self.samples:  # the share's own size (`len(batch)` there)
            weight = float(self.samples)
        else:  # a count of the worker's own, such as its tokens
            weight = float(batch_size)
        metric, states = None, ()
        if isinstance(value, Metric):
            metric = arguments.get("metric_attribute") or self._metric_path(value, name)
            state = self._batch_states.get(id(value))
            states = (state,) if state is not None and self.samples else ()
            value = value._forward_cache
        self.logs.append(LoggedValue(name, _scalar(name, value), weight, _dtype(value), options, metric, share, states))

    def _metric_path(self, metric: Metric, name: str) -> str:
        path = _METRIC_PATHS.get(id(metric))
        if path is not None and _submodule(self.module, path) is metric:
            return path
        for path, module in self.module.named_modules():
            if module is metric:
                _METRIC_PATHS[id(metric)] = path
                return path
        raise ValueError(
            f"`self.log({name!r}, metric)`: the metric is not an attribute of the LightningModule. Assign it to"
            " the module (e.g. `self.train_acc = Accuracy(...)`) so every worker holds its own copy."
        )


_METRIC_PATHS: dict[int, str] = {}
"""Where in its module each metric logged as an object was last found, by the metric's id (checked
at each use: an id may come back for another object): a walk of the module's tree per step saved."""


def _submodule(module: nn.Module, path: str) -> Any:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _scalar(name: str, value: Any) -> float | Tensor | None:
    """A logged value as a number, or a detached one-element tensor left on its device (read on the
    host with the step's other results: ``WorkerReport.to_host``)."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"`self.log({name!r}, ...)` must log a scalar, got a tensor of shape {tuple(value.shape)}.")
        if value.is_meta:
            raise ValueError(
                f"`self.log({name!r}, ...)` logs a value computed from layers this pipeline stage does not hold"
                " (they exist only on the meta device here). Log what the step computes from its outputs, or"
                " train the model as replicas (`parallelism='replicas'`)."
            )
        return value.detach().reshape(()).clone()  # as Lightning keeps it: later in-place changes do not count
    if isinstance(value, numbers.Number):
        return float(value)  # type: ignore[arg-type]
    raise TypeError(f"`self.log({name!r}, ...)` got a {type(value).__name__}; log a number, tensor or Metric.")


def _dtype(value: Any) -> torch.dtype | None:
    return value.dtype if isinstance(value, Tensor) else None


class ReportExchange:
    """Every rank's report, on every rank, in one exchange over ``group`` (all ranks by default).

    ``dist.all_gather_object`` takes two collectives and several copies per call, which costs
    milliseconds a step where processes share cores. Here each rank pickles its report once and
    sends it to every other. Where the group's processes all run on this host, over a Unix socket
    between every pair (``mesh.LocalMesh``: the kernel wakes the receiver itself, where gloo's
    thread would wait for a core); otherwise over gloo, in fixed-size buffers (``_Gather``).

    [Note: one-way exchange]
    In a batch of which the CPU workers compute nothing (the CPU fraction is 0, or the batch is
    too small to share), their reports are empty, and waiting for them would only make the stages
    wait for processes with nothing to tell: on a machine where they share cores, for a process's
    turn to run Lightning's loop. So, on one host (``cpu_workers`` CPU workers, global ranks
    ``0 .. cpu_workers - 1``, then the stages), ``one_way=True`` has the stages share their reports
    among themselves (``stages``, a group of them; none where there is one stage) and the first
    stage send them to every CPU worker without waiting for them to be read: a CPU worker may fall
    behind (as many steps as a socket's buffer holds reports), and the next step it computes in
    brings it level. Every rank ends with the
    same list, the CPU workers' reports empty, except that a CPU worker keeps its own device stats
    (the stages and the other CPU workers do not see them in such a step). Every rank decides
    ``one_way`` alike, from the shares of the optimizer step's batches. (A CPU worker's own entry
    leaves out its noted signals too, which every rank must agree on: they travel with the next
    step it computes in.) Across hosts, every exchange goes both ways.

    ``mesh``: the Unix sockets between ``group``'s processes (``LocalMesh.connect``), where they all
    run on this host; ``None``: gloo (and no one-way exchange).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        capacity: int = 4096,
        *,
        mesh: LocalMesh | None = None,
        cpu_workers: int = 0,
        stages: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        self._rank = dist.get_rank(group)
        self._mesh = mesh
        self._all: _Gather | _MeshGather
        self._stages: _MeshGather | None
        self._stages = None  # (over gloo, unused: every exchange goes both ways)
        if mesh is None:
            self._all = _Gather(group, capacity)
            cpu_workers = 0
        else:
            self._all = _MeshGather(mesh, range(dist.get_world_size(group)))
            if stages is not None:
                members = [r if group is None else dist.get_group_rank(group, r) for r in dist.get_process_group_ranks(stages)]
                self._stages = _MeshGather(mesh, members)
        self._cpu_workers = cpu_workers

    @property
    def capacity(self) -> int | None:
        """The size of the buffers that carry a report over gloo (``None`` over Unix sockets)."""
        return self._all.capacity if isinstance(self._all, _Gather) else None

    def __call__(self, report: WorkerReport, one_way: bool = False) -> list[WorkerReport]:
        report.to_host()
        if not (one_way and self._cpu_workers):
            return self._all(report)
        assert self._mesh is not None
        first_stage = self._cpu_workers
        if self._rank < first_stage:
            stage_reports = pickle.loads(self._mesh.receive(POSTS, first_stage))
        else:
            stage_reports = self._stages(report) if self._stages is not None else [report]
            if self._rank == first_stage:
                self._mesh.send(POSTS, pickle.dumps(stage_reports, protocol=pickle.HIGHEST_PROTOCOL), range(first_stage))
        own = dataclasses.replace(report, signals=0)
        cpu_reports = [own if rank == self._rank else WorkerReport() for rank in range(first_stage)]
        return cpu_reports + stage_reports


class _MeshGather:
    """Every member's report (``members``: ranks in the mesh's group), in the members' order, over
    the mesh (``LocalMesh.all_gather_object``)."""

    def __init__(self, mesh: LocalMesh, members: Any) -> None:
        self.mesh = mesh
        self._members = list(members)

    def __call__(self, obj: Any) -> list[Any]:
        if len(self._members) == 1:  # a group of one has nobody to tell
            return [obj]
        return self.mesh.all_gather_object(obj, self._members, REPORTS)


class _Gather:
    """Every member's object, pickled into fixed-size buffers that every member sends every other
    over gloo (``ReportExchange``, across hosts). Every member sees every length, so when a report
    outgrows the buffer all members agree to gather again at the largest size, and keep that size
    from then on.

    In a group of a few processes the buffers go as sends and receives between every pair, all
    posted, then waited for. gloo runs a collective such as ``all_gather`` on a thread of its own,
    and where the cores are busy the handover to that thread and back is slow to come: between two
    processes that compute on two cores, an all-gather took 0.9 ms on average after the later one
    arrived (0.28 at the median, 3.4 one time in ten), the sends 0.23 ms (0.19, 0.33). In a larger
    group, whose every member would post ``n - 1`` sends, the all-gather's ring carries them.
    """

    def __init__(self, group: dist.ProcessGroup | None, capacity: int) -> None:
        self.group = group
        self.capacity = capacity
        self._world = dist.get_world_size(group)
        self._me = dist.get_rank(group)

    def __call__(self, obj: Any) -> list[Any]:
        if self._world == 1:  # a group of one has nobody to tell
            return [obj]
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            gathered = self._gather(data, self.capacity)
        except RuntimeError as error:
            note_not_answered(error, "The step's reports did not travel between the ranks")
            raise
        lengths = gathered[:, :_HEADER].contiguous().view(torch.int64).flatten().tolist()
        if max(lengths) > self.capacity:
            self.capacity = max(lengths)
            gathered = self._gather(data, self.capacity)
        return [pickle.loads(row[_HEADER : _HEADER + n].numpy().tobytes()) for row, n in zip(gathered, lengths)]

    def _gather(self, data: bytes, capacity: int) -> Tensor:
        buffer = _framed(data, capacity)
        out = torch.empty(self._world, _HEADER + capacity, dtype=torch.uint8)
        if self._world > _PAIRWISE_UP_TO:
            dist.all_gather(list(out.unbind()), buffer, group=self.group)
            return out
        out[self._me] = buffer
        others = [r for r in range(self._world) if r != self._me]
        works = [dist.isend(buffer, group_dst=r, group=self.group, tag=_GATHER_TAG) for r in others]
        works += [dist.irecv(out[r], group_src=r, group=self.group, tag=_GATHER_TAG) for r in others]
        for work in works:
            work.wait()
        return out


def _framed(data: bytes, capacity: int) -> Tensor:
    """``data``'s length, then as much of ``data`` as fits, in a buffer of ``_HEADER + capacity`` bytes."""
    buffer = torch.zeros(_HEADER + capacity, dtype=torch.uint8)
    buffer[:_HEADER] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    fits = data[:capacity]
    if fits:
        buffer[_HEADER : _HEADER + len(fits)] = torch.frombuffer(bytearray(fits), dtype=torch.uint8)
    return buffer


_GATHER_TAG = 7303

_PAIRWISE_UP_TO = 16
"""The largest group whose reports travel as sends between every pair (``_Gather``)."""


_HEADER = 8  # bytes: each report's pickled length, as an int64


def combine_loss(reports: list[WorkerReport]) -> tuple[float, torch.dtype | None] | None:
    """The whole batch's loss: the workers' mean losses weighted by their sample counts."""
    parts = [(r.samples, r.loss, r.loss_dtype) for r in reports if r.samples and r.loss is not None]
    if not parts:
        return None
    total = sum(n for n, _, _ in parts)
    return sum(n * loss for n, loss, _ in parts) / total, parts[0][2]


def combine_logs(reports: list[WorkerReport]) -> list[LoggedValue]:
    """One value per ``self.log`` call of the step method, the workers' calls combined: each
    worker's first call of a name with the others' first, its second with their second (logged
    again in that order, the last is the step's value and every one counts toward the epoch's, as
    in one process), in the order they first appear (ranks in order)."""
    by_call: dict[tuple[str, int], list[LoggedValue]] = {}
    for report in reports:
        calls: dict[str, int] = {}
        for item in report.logs:
            nth = calls[item.name] = calls.get(item.name, -1) + 1
            by_call.setdefault((item.name, nth), []).append(item)
    return [_combine(name, items) for (name, _), items in by_call.items()]


def _combine(name: str, items: list[LoggedValue]) -> LoggedValue:
    first = items[0]
    for other in items[1:]:
        if other.options != first.options or other.metric != first.metric:
            raise ValueError(
                f"`self.log({name!r}, ...)` was called with different arguments by different workers (the CPU"
                " worker and the pipeline's last stage run the same step method); log it the same way everywhere."
            )
    shares = [i.share for i in items if i.share is not None]
    if len(shares) == len(items) and len({i.weight for i in items}) == 1 and sum(shares):
        # Every worker passed the loader's batch size on a batch of another size (its last): a fixed
        # `batch_size` (a hyperparameter), which one process would pass for the whole batch too.
        # The value weighs the shares by their samples, and the batch weighs that number.
        given, total = items[0].weight, sum(shares)
        items = [dataclasses.replace(i, weight=given * (i.share or 0) / total) for i in items]
    weight = sum(i.weight for i in items)
    valued = [i for i in items if i.value is not None]
    if len(valued) == 1:  # one worker's value is the batch's, as it is (a weighted mean of one can be off by an ulp)
        value = valued[0].value
    else:
        value = _reduce(first.options.get("reduce_fx", "mean"), valued) if valued else None
    # The whole batch's metric value is computed from the shares' states (`relog`), except where one
    # worker logged it: its forward gave that value from its one state, and no rank computes it again.
    alone = len(items) == 1 and valued
    states = tuple(state for i in items for state in i.states) if all(i.states for i in items) and not alone else ()
    return LoggedValue(name, value, weight, first.dtype, first.options, first.metric, states=states)


def _reduce(reduce_fx: Any, items: list[LoggedValue]) -> float:
    how = _REDUCE_NAMES.get(reduce_fx, reduce_fx)
    values = [i.value for i in items]
    if how == "mean":
        total = sum(i.weight for i in items)
        return sum(i.weight * i.value for i in items) / total if total else sum(values) / len(values)
    if how == "sum":
        return sum(values)
    if how == "max":
        return max(values)
    if how == "min":
        return min(values)
    return float(reduce_fx(torch.tensor(values, dtype=torch.float64)))


def relog(module: LightningModule, values: list[LoggedValue], device: torch.device) -> None:
    """Log the combined values through Lightning, on this rank."""
    for item in values:
        options = dict(item.options, sync_dist=False)
        weight = int(item.weight) if float(item.weight).is_integer() else item.weight
        if item.metric is not None:
            metric = module.get_submodule(item.metric)
            if item.states:  # the whole batch's value, from the shares' states
                metric._forward_cache = _batch_value(metric, item.states)
            elif item.value is not None:
                metric._forward_cache = torch.tensor(item.value, dtype=item.dtype, device=metric.device)
            module.log(item.name, metric, batch_size=weight, metric_attribute=item.metric, **options)
        else:
            value = item.value if item.dtype is None else torch.tensor(item.value, dtype=item.dtype, device=device)
            module.log(item.name, value, batch_size=weight, **options)


def _merges(metric: Metric) -> bool:
    """Whether a metric's batch states merge into the state of their union (``Metric.merge_state``)."""
    return metric.full_state_update is False and not metric.dist_sync_on_step


def _noting_batch_state(metric: Metric, compute: Any, noted: dict[int, dict[str, Any]]) -> Any:
    """``metric.compute``, noting the state it computes from where that is the batch's alone: in
    ``forward``, which then merges it into the metric's running state (``_enable_grad`` is set
    there only)."""
    if getattr(metric, "_enable_grad", False):
        # A copy on its device, taken to the host with the step's results (`WorkerReport.to_host`).
        noted[id(metric)] = apply_to_collection(metric.metric_state, Tensor, lambda t: t.detach().clone())
    return compute()


_SCRATCH: dict[int, Metric] = {}
"""Per logged metric, by its id, a copy of it that computes the whole batch's value from the shares'
states; an entry goes with its metric. (Not a weak dictionary keyed by the metric: a metric's hash
changes with its state tensors, which every ``forward`` replaces, so each step would find none.)"""


def _scratch(metric: Metric) -> Metric:
    """``metric``'s copy in ``_SCRATCH``, made on first use."""
    scratch = _SCRATCH.get(id(metric))
    if scratch is None:
        scratch = _SCRATCH[id(metric)] = _empty_copy(metric)
        weakref.finalize(metric, _SCRATCH.pop, id(metric), None)
    return scratch


def _empty_copy(metric: Metric) -> Metric:
    """A copy of ``metric`` to compute with. Its process group cannot be copied: the copy shares it
    (and never syncs). Its tensors, which ``reset`` replaces, are taken detached: one computed with
    autograd (the last ``forward``'s value, a batch's part of a list state) cannot be copied. It
    gets none of the hooks on it and its children (a profiler's, which hold what cannot be copied):
    it only computes."""
    memo: dict[int, Any] = {}
    if metric.process_group is not None:
        memo[id(metric.process_group)] = metric.process_group
    for module in metric.modules():
        for name, value in vars(module).items():
            if "hooks" in name and isinstance(value, dict):
                memo[id(value)] = type(value)()
    for value in vars(metric).values():
        for tensor in value if isinstance(value, list) else [value]:
            if isinstance(tensor, Tensor):
                memo[id(tensor)] = tensor.detach()
    return copy.deepcopy(metric, memo)


def _batch_value(metric: Metric, states: tuple[dict[str, Any], ...]) -> Tensor:
    """What ``metric`` computes for the union of the shares' batch states, as one process's
    ``forward`` on the whole batch gives it (without a collective: every rank has every state)."""
    scratch = _scratch(metric)
    scratch.reset()
    for state in states:
        scratch.merge_state(move_data_to_device(state, metric.device))
    scratch._update_count, scratch._to_sync, scratch._should_unsync = len(states), False, False
    with torch.no_grad():
        return scratch.compute()


def merge_outputs(parts: list[tuple[int, Any]], path: str = "the output") -> Any:
    """Join the outputs of workers' shares, given as ``(samples, output)`` in batch order, into what
    one process would have returned for the whole batch.

    A tensor with one row per sample (its first dimension the share's samples) is concatenated
    along it; a list or tuple of such tensors (``[logits, probs]``) or a dict is joined entry by
    entry; any other list or tuple with one entry per sample (strings, per-sample sequences) is
    extended. A value that is not per sample (a number, a 0-dim tensor, a tensor of another first
    dimension) is kept where every share gave the same (``batch_idx``); otherwise the shares'
    values cannot make the batch's (a share's mean is not the batch's), and that is an error.
    """
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0][1]
    outputs = [out for _, out in parts]
    first = outputs[0]
    if isinstance(first, Tensor) and all(isinstance(o, Tensor) and o.dim() > 0 and len(o) == n for n, o in parts):
        return torch.cat(outputs)
    if isinstance(first, Mapping) and all(isinstance(o, Mapping) and o.keys() == first.keys() for o in outputs):
        return type(first)({k: merge_outputs([(n, out[k]) for n, out in parts], f"{path}[{k!r}]") for k in first})
    if isinstance(first, (list, tuple)) and all(isinstance(o, (list, tuple)) for o in outputs):
        batched = all(isinstance(o, Tensor) and o.dim() > 0 and len(o) == n for n, out in parts for o in out)
        if not batched and all(len(out) == n for n, out in parts):
            return type(first)(item for out in outputs for item in out)
        if all(len(out) == len(first) for out in outputs):
            return type(first)(merge_outputs([(n, out[i]) for n, out in parts], f"{path}[{i}]") for i in range(len(first)))
    if all(_same(first, out) for out in outputs[1:]):
        return first
    raise ValueError(
        f"`predict_step` returned {path} as {_describe(first)}, not one row per sample, and the workers' shares of"
        " the batch gave different values, so no value of the whole batch can be made of them (as a share's mean"
        " is not the batch's): under the hetero strategy each worker predicts its share of every batch, and the"
        " shares' outputs are joined sample by sample. Return per-sample values (tensors or lists whose first"
        " dimension is the batch's) and reduce them after `trainer.predict`."
        + (
            " A model's key/value cache is no per-sample value: call the model with `use_cache=False`, or return"
            " what you need of its output (its `logits`)."
            if type(first).__name__.endswith("Cache")
            else ""
        )
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:
        return False


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    shown = repr(value)
    return f"the {type(value).__name__} {shown}" if len(shown) <= 40 else f"a {type(value).__name__}"


def sync_metrics_over(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Sync every torchmetrics ``Metric`` of the module over ``group`` (gloo), through CPU copies:
    a metric's state may sit on a GPU stage on one rank and on the CPU on another.

    A metric made with ``dist_sync_on_step=True`` syncs in ``compute`` only, as the others: its step
    value, logged as an object, is the whole batch's already (the workers' batch states merged,
    ``relog``), as that option gives it under DDP. Its sync in ``forward`` would be a collective in
    the step method, which the processes without a share of the batch (a stage before the last)
    never run."""
    for metric in module.modules():
        if isinstance(metric, Metric):
            metric.process_group = group
            metric.dist_sync_fn = _gather_on_cpu
            metric.dist_sync_on_step = False


def _gather_on_cpu(tensor: Tensor, group: Any = None) -> list[Tensor]:
    """Every rank's ``tensor``, in one dtype: the one every rank's non-empty state promotes to. A
    state that this rank's updates never touched (a stage before the last, a CPU worker without a
    share) keeps the dtype torchmetrics made it in (float32; an empty list state becomes an empty
    float32 tensor), where the other ranks' updates made theirs float64 (``64-true``) or int64 (a
    list of targets), and gloo cannot gather tensors of different sizes. Its shape is ``(0,)``
    where the others' are ``(n, classes)`` (a multiclass metric's predictions): torchmetrics pads
    tensors to one size, but not to one number of dimensions. Every rank gathers the dtypes and
    shapes first, so every rank takes part in the same collectives, and an empty state takes the
    others' dtype and the dimensions after their first."""
    local = tensor.cpu()
    shape = list(local.shape) if local.dim() <= _MOST_DIMS else []
    code = _DTYPES.index(local.dtype) if local.dtype in _DTYPES else -1
    mine = torch.tensor([code, local.numel(), len(shape), *shape, *[0] * (_MOST_DIMS - len(shape))])
    rows = gather_all_tensors(mine, group)
    found = [(int(row[0]), int(row[1]), tuple(int(d) for d in row[3 : 3 + int(row[2])])) for row in rows]
    dtypes = [_DTYPES[code] for code, numel, _ in found if numel and code >= 0]
    if dtypes and -1 not in (code for code, _, _ in found):
        local = local.to(functools.reduce(torch.promote_types, dtypes))
    trailing = {dims[1:] for _, numel, dims in found if numel and dims}
    if not local.numel() and len(trailing) == 1:
        local = local.reshape(0, *trailing.pop())
    return [t.to(tensor.device) for t in gather_all_tensors(local, group)]


_MOST_DIMS = 8
"""The most dimensions of a state whose shape ``_gather_on_cpu`` makes an empty state's."""


_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64]
