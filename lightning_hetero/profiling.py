"""Measuring the workload: every layer on every kind of device in the run, and the links between them.

For each layer the profiler measures, on the device it is given (a stage's GPU, an emulated
stage's CPU process, or the CPU worker with its threads), the forward and the backward time at
two batch sizes (fitted as ``a + b * samples``, so the planner can price any micro-batch size),
the parameter, gradient and optimizer-state memory, the activation memory its backward keeps,
and its FLOPs (``torch.utils.flop_counter``). Measurements are repeated after a warm-up and the
median is kept. Links are measured the same way: the all-reduce between a stage and the CPU
workers, sends between stages, and host<->device copies where there is CUDA.

Profiling leaves every layer where it found it, on the device and in the mode it had.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from tqdm.auto import tqdm
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.utils.flop_counter import FlopCounterMode

from lightning_hetero.files import atomic_write
from lightning_hetero.mesh import LocalMesh, sum_over
from lightning_hetero.module import run_layers, tied_parameters
from lightning_hetero.shares import batch_size_of, slice_batch

__all__ = [
    "LayerProfile",
    "TiedProfile",
    "tied_layers",
    "DeviceTimes",
    "LinkProfile",
    "Profile",
    "profile_layers",
    "time_optimizer",
    "profile_loss",
    "time_link",
    "step_work",
    "time_window",
    "kept_buffers",
    "all_reduce_over",
    "send_along",
    "time_pipeline_action",
    "gradient_sum_over",
    "optimizer_state_factor",
    "EncoderTimes",
    "time_encoders",
]


@dataclass
class LayerProfile:
    """What one layer holds and does, whatever the device."""

    name: str
    params: int
    param_bytes: int
    activation_bytes: float
    """Per sample: the tensors its backward keeps from its forward."""
    output_bytes: float
    """Per sample: its output, which a stage boundary after it sends on."""
    flops: float
    """Per sample, forward and backward."""


@dataclass
class DeviceTimes:
    """One kind of device's time per layer: ``intercept + slope * samples`` seconds."""

    device: str
    threads: int
    forward: list[tuple[float, float]]
    backward: list[tuple[float, float]]
    optimizer_s_per_param: float = 0.0
    """The user's optimizer on this device, per parameter."""
    offloaded_s_per_param: float = 0.0
    """The fused CPU optimizer of an offloaded bucket, per parameter (CPU devices)."""
    loss_forward: tuple[float, float] = (0.0, 0.0)
    """The module's ``pipeline_loss`` on the last layer's output: forward ..."""
    loss_backward: tuple[float, float] = (0.0, 0.0)
    """... and backward, like a layer's."""
    step_s_by_threads: dict[int, float] = field(default_factory=dict)
    """A CPU device's time for the whole model's training compute on the batch, by the
    threads it had (those it computes with in each layout): how its speed follows its threads."""
    action_s: float = 0.0
    """What one action of a pipeline schedule (a stage's forward or backward of one micro-batch)
    costs a stage process beyond its layers: torch's pipelining runtime and the strategy's around
    it, and its send's latency (``time_pipeline_action``; the profile's pipeline link then keeps only
    the bandwidth its bytes take)."""

    def thread_speedup(self, threads: int) -> float:
        """How many times as fast with ``threads`` as profiled: as measured where both counts
        were, else in proportion to the threads (an upper bound: memory bandwidth does not grow
        with them)."""
        measured = self.step_s_by_threads
        if threads in measured and self.threads in measured:
            return measured[self.threads] / measured[threads]
        return threads / self.threads

    def layer_time(self, layers: range, samples: float) -> float:
        """Forward and backward of ``layers`` for a micro-batch of ``samples``; where ``layers`` end
        with the model's last, the loss's too (it is computed where the last layer is)."""
        total = sum(
            self.forward[i][0] + self.forward[i][1] * samples + self.backward[i][0] + self.backward[i][1] * samples
            for i in layers
        )
        if layers and layers.stop == len(self.forward):
            total += self.loss_step_time(samples)
        return total

    def loss_step_time(self, samples: float) -> float:
        """The loss's forward and backward for a micro-batch of ``samples``."""
        return sum(fit[0] + fit[1] * samples for fit in (self.loss_forward, self.loss_backward))

    def loss_forward_time(self, samples: float) -> float:
        """The loss's forward alone, as the last stage computes it once more when it replays the
        module's step method on the pipeline's outputs."""
        return self.loss_forward[0] + self.loss_forward[1] * samples if samples else 0.0

    def forward_time(self, layers: range, samples: float) -> float:
        return sum(self.forward[i][0] + self.forward[i][1] * samples for i in layers)

    def backward_time(self, layers: range, samples: float) -> float:
        return sum(self.backward[i][0] + self.backward[i][1] * samples for i in layers)


@dataclass
class LinkProfile:
    """A link: ``latency + bytes / bandwidth`` seconds per transfer."""

    latency: float
    bytes_per_s: float

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bytes_per_s if nbytes > 0 else 0.0


@dataclass
class TiedProfile:
    """Parameters that several layers use (tied weights): each of ``layers`` counts them in its
    ``LayerProfile``, and a process holding several of those layers holds them once."""

    layers: list[int]
    params: int
    param_bytes: int


def tied_layers(layers: Sequence[nn.Module]) -> list[TiedProfile]:
    """The tied weights of a model's blocks, by the blocks that use them."""
    return [
        TiedProfile(list(using), sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params))
        for using, params in tied_parameters(layers, [(i, i + 1) for i in range(len(layers))])
    ]


@dataclass
class Profile:
    """Everything the planner needs to know about a workload on a machine."""

    batch_size: int
    layers: list[LayerProfile]
    devices: dict[str, DeviceTimes]
    """By role: ``"cpu"`` (a CPU worker) and ``"stage0"``, ``"stage1"``, ... (each stage's device)."""
    links: dict[str, LinkProfile] = field(default_factory=dict)
    """``"sync"``: stage <-> CPU workers all-reduce; ``"pipeline"``: stage -> stage;
    ``"d2h"``/``"h2d"``: device <-> pinned host memory."""
    optimizer_state_factor: float = 2.0
    """Optimizer state per parameter, in parameter copies (Adam: 2, SGD with momentum: 1)."""
    cpu_cores: int = 1
    device_memory: dict[str, float] = field(default_factory=dict)
    """Bytes usable per stage role (absent: unlimited, as for emulated stages)."""
    step_overhead_s: float = 0.0
    """Per step, outside the model: the training loop's own work (loading the batch, Lightning's
    hooks and logging) and sharing the step's results between the ranks. ``WorkloadAnalyzer``
    first estimates it from the batch load and the exchange alone, then measures it in the run's
    first steps."""
    step_method_s_per_sample: float = 0.0
    """The module's step method beyond the model and its loss (metrics, logging), per sample:
    the last stage pays it when it replays the method on the pipeline's share, a CPU worker with
    its own. ``WorkloadAnalyzer`` measures it in the run's first steps."""
    shared_cores: dict[str, float] = field(default_factory=dict)
    """The cores' worth that the processes computing on the CPU got when they computed at once
    (measured; they can get less than the cores, as they share caches and memory bandwidth):
    ``"shared"``, every CPU worker and emulated stage (layouts with a CPU share); ``"stages"``, the
    emulated stages alone (layouts without). Absent: as many as the cores."""
    numa_nodes: list[list[int]] = field(default_factory=list)
    """The cores of each NUMA node this process may use (``numa.py``); empty: not recorded."""
    tied: list[TiedProfile] = field(default_factory=list)
    """The weights several layers use (``tied_layers``); each of those layers counts them."""

    def held(self, layers: Iterable[int]) -> tuple[int, int]:
        """The parameters, and their bytes, that a process holding ``layers`` holds: a tied weight
        once, however many of its layers it holds."""
        layers = set(layers) if self.tied else list(layers)
        params = sum(self.layers[i].params for i in layers)
        nbytes = sum(self.layers[i].param_bytes for i in layers)
        for tied in self.tied:
            extra = len(layers.intersection(tied.layers)) - 1
            if extra > 0:
                params -= extra * tied.params
                nbytes -= extra * tied.param_bytes
        return params, nbytes

    def save(self, path: Union[str, Path]) -> Path:
        """Write the profile as JSON, whole or not at all (``atomic_write``)."""
        with atomic_write(path, "w") as f:
            f.write(json.dumps(asdict(self), indent=1))
        return Path(path)

    @classmethod
    def load(cls, path: Union[str, Path]) -> Profile:
        try:
            return cls._from_dict(json.loads(Path(path).read_text()))
        except (KeyError, TypeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path} is not a profile written by WorkloadAnalyzer ({error!r}).") from error

    @classmethod
    def _from_dict(cls, raw: dict[str, Any]) -> Profile:
        return cls(
            batch_size=raw["batch_size"],
            layers=[LayerProfile(**layer) for layer in raw["layers"]],
            devices={
                role: DeviceTimes(
                    **{
                        **d,
                        "forward": [tuple(x) for x in d["forward"]],
                        "backward": [tuple(x) for x in d["backward"]],
                        "loss_forward": tuple(d.get("loss_forward", (0.0, 0.0))),
                        "loss_backward": tuple(d.get("loss_backward", (0.0, 0.0))),
                        "step_s_by_threads": {int(n): t for n, t in d.get("step_s_by_threads", {}).items()},
                    }
                )
                for role, d in raw["devices"].items()
            },
            links={name: LinkProfile(**link) for name, link in raw.get("links", {}).items()},
            optimizer_state_factor=raw.get("optimizer_state_factor", 2.0),
            cpu_cores=raw.get("cpu_cores", 1),
            device_memory=raw.get("device_memory", {}),
            step_overhead_s=raw.get("step_overhead_s", 0.0),
            step_method_s_per_sample=raw.get("step_method_s_per_sample", 0.0),
            shared_cores=raw.get("shared_cores", {}),
            numa_nodes=raw.get("numa_nodes", []),
            tied=[TiedProfile(**t) for t in raw.get("tied", [])],
        )


def optimizer_state_factor(optimizer: torch.optim.Optimizer | None) -> float:
    """Optimizer state per parameter, in parameter copies, for the optimizers whose state is known."""
    if optimizer is None:
        return 2.0
    if isinstance(optimizer, torch.optim.SGD):
        return 1.0 if any(group.get("momentum", 0) for group in optimizer.param_groups) else 0.0
    if isinstance(optimizer, (torch.optim.Adagrad, torch.optim.RMSprop)):
        return 1.0
    return 2.0


def _median_time(work: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        work()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fit(small: int, t_small: float, large: int, t_large: float) -> tuple[float, float]:
    """``(intercept, slope)`` through two measurements, never negative."""
    slope = max(0.0, (t_large - t_small) / (large - small)) if large != small else t_large / max(large, 1)
    return max(0.0, t_small - slope * small), slope


def _requires_grad(inputs: Any) -> Any:
    if isinstance(inputs, tuple):
        return tuple(_requires_grad(x) for x in inputs)
    if isinstance(inputs, Tensor) and inputs.is_floating_point():
        return inputs.detach().requires_grad_()
    return inputs


def _outputs(outputs: Any) -> list[Tensor]:
    items = outputs if isinstance(outputs, tuple) else (outputs,)
    return [o for o in items if isinstance(o, Tensor) and o.requires_grad]


def _forward_backward(layer: nn.Module, inputs: Any) -> tuple[Callable[[], Any], Callable[[], None]]:
    """Two closures: the layer's forward, and forward + backward (with a gradient of ones)."""

    def forward() -> Any:
        with torch.no_grad():
            return run_layers([layer], inputs)

    def both() -> None:
        outputs = _outputs(run_layers([layer], _requires_grad(inputs)))
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])

    return forward, both


def _saved_bytes(layer: nn.Module, inputs: Any) -> int:
    """Bytes of the activations autograd keeps for the layer's backward (each storage once; the
    layer's own parameters, which it also keeps, are counted as parameters)."""
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_layers([layer], _requires_grad(inputs))
    return sum(seen.values())


def _flops(layer: nn.Module, inputs: Any) -> float:
    counter = FlopCounterMode(display=False)
    with counter:
        outputs = _outputs(run_layers([layer], _requires_grad(inputs)))
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    return float(counter.get_total_flops())


def _nbytes(data: Any) -> int:
    items = data if isinstance(data, tuple) else (data,)
    return sum(x.numel() * x.element_size() for x in items if isinstance(x, Tensor))


def profile_layers(
    layers: Sequence[nn.Module],
    names: Sequence[str],
    inputs: Any,
    device: torch.device,
    sizes: tuple[int, int],
    repeats: int = 3,
    progress: str | None = None,
    loss: Optional[tuple[Callable[[Any, Any], Tensor], Any]] = None,
) -> tuple[list[tuple[float, float]], list[tuple[float, float]], list[LayerProfile], tuple[tuple[float, float], ...]]:
    """Time every layer's forward and backward on ``device`` at two micro-batch ``sizes``, and
    describe each layer's memory and FLOPs (``LayerProfile``, the same on every device). With
    ``loss`` (the loss function and the batch's targets), the loss on the last layer's output is
    timed too (``profile_loss``); the last item returned is its ``(forward, backward)`` fits.

    ``inputs`` is a batch of at least ``max(sizes)`` samples; each layer runs on the previous
    layer's output. Each layer visits ``device`` only while it is measured and then goes back
    where it was, in the mode it was in; the random number generators and the layers' buffers
    (running statistics) are left as they were. With ``progress``, a progress bar of that title
    counts the layers.
    """
    small, large = sorted(sizes)
    forward, backward, described = [], [], []
    x = inputs
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), kept_buffers(layers):
        bar = tqdm(zip(layers, names), total=len(layers), desc=progress, disable=progress is None, leave=False)
        for layer, name in bar:
            home = next(itertools.chain((t.device for t in layer.parameters()), (t.device for t in layer.buffers())), None)
            training = layer.training
            layer.to(device)
            try:
                fwd, bwd = zip(*(_time_layer(layer, move_data_to_device(slice_batch(x, 0, n), device), device, repeats) for n in (small, large)))
                forward.append(_fit(small, fwd[0], large, fwd[1]))
                backward.append(_fit(small, bwd[0], large, bwd[1]))
                described.append(_describe(layer, name, move_data_to_device(slice_batch(x, 0, large), device), large))
                with torch.no_grad():
                    x = move_data_to_device(run_layers([layer], move_data_to_device(x, device)), "cpu")
            finally:
                layer.zero_grad(set_to_none=True)
                layer.train(training)
                if home is not None:
                    layer.to(home)
    fits = profile_loss(loss[0], x, loss[1], device, sizes, repeats) if loss is not None else ((0.0, 0.0), (0.0, 0.0))
    return forward, backward, described, fits


def profile_loss(
    loss: Callable[[Any, Any], Tensor], outputs: Any, targets: Any, device: torch.device, sizes: tuple[int, int], repeats: int = 3
) -> tuple[tuple[float, float], tuple[float, float]]:
    """``(forward, backward)`` fits of ``loss(outputs, targets)`` on ``device`` at two micro-batch
    ``sizes`` (``outputs``: the last layer's, for a batch of at least ``max(sizes)`` samples). A loss
    that cannot be timed this way (it fails on these arguments) counts as free, with a warning."""
    small, large = sorted(sizes)
    timed = []
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for n in (small, large):
                out = move_data_to_device(slice_batch(outputs, 0, n), device)
                target = move_data_to_device(slice_batch(targets, 0, n), device)

                def forward(out: Any = out, target: Any = target) -> Any:
                    with torch.no_grad():
                        return loss(out, target)

                def both(out: Any = out, target: Any = target) -> None:
                    loss(_requires_grad(out), target).backward()

                t_forward = _median_time(forward, device, repeats)
                timed.append((t_forward, max(0.0, _median_time(both, device, repeats) - t_forward)))
    except Exception as error:  # the loss is an estimate's detail: never worth failing the fit for
        rank_zero_warn(f"WorkloadAnalyzer could not time `pipeline_loss` on its own ({error!r}); the plan counts it as free.")
        return (0.0, 0.0), (0.0, 0.0)
    return _fit(small, timed[0][0], large, timed[1][0]), _fit(small, timed[0][1], large, timed[1][1])


def _time_layer(layer: nn.Module, inputs: Any, device: torch.device, repeats: int) -> tuple[float, float]:
    """(forward, backward) seconds of ``layer`` on ``inputs`` (backward: forward+backward - forward)."""
    forward, both = _forward_backward(layer, inputs)
    t_forward = _median_time(forward, device, repeats)
    return t_forward, max(0.0, _median_time(both, device, repeats) - t_forward)


def _describe(layer: nn.Module, name: str, inputs: Any, samples: int) -> LayerProfile:
    with torch.no_grad():
        out = run_layers([layer], inputs)
    return LayerProfile(
        name=name,
        params=sum(p.numel() for p in layer.parameters()),
        param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
        activation_bytes=_saved_bytes(layer, inputs) / samples,
        output_bytes=_nbytes(out) / samples,
        flops=_flops(layer, inputs) / samples,
    )


def time_optimizer(
    optimizer_cls: type,
    device: torch.device,
    numel: int = 1 << 20,
    repeats: int = 3,
    shapes: Optional[Sequence[torch.Size]] = None,
    max_numel: int = 1 << 25,
    **kwargs: Any,
) -> float:
    """Seconds per parameter of one step of ``optimizer_cls`` on ``device``: on parameters of the
    given ``shapes`` (a model's, as many as fit in ``max_numel``: the step's cost per parameter
    depends on how many tensors there are and whether they fit in cache), or on one of ``numel``."""
    shapes = list(shapes) if shapes else [torch.Size([numel])]
    kept, total = [], 0
    for shape in shapes:
        if kept and total + shape.numel() > max_numel:
            break
        kept.append(shape)
        total += shape.numel()
    params = [nn.Parameter(torch.randn(shape, device=device)) for shape in kept]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = optimizer_cls(params, lr=1e-3, **kwargs)
    return _median_time(optimizer.step, device, repeats) / max(1, total)


@contextmanager
def kept_buffers(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Put the modules' buffers (BatchNorm's running statistics, say) back as they were afterwards:
    a forward in training mode for a measurement must not count as training."""
    saved = [b.detach().clone() for module in modules for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():  # the buffers as they are now: moving a module replaces its tensors
            for buffer, value in zip((b for module in modules for b in module.buffers()), saved):
                buffer.copy_(value)


def step_work(layers: Sequence[nn.Module], loss: Callable[[Any, Any], Tensor], inputs: Any, targets: Any) -> Callable[[], None]:
    """One training step's compute on ``inputs``: the layers' forward, the loss and the backward to
    the parameters, whose gradients are returned and dropped, never accumulated. Call it inside
    ``kept_buffers`` and ``torch.random.fork_rng`` to leave no trace."""
    params = [p for layer in layers for p in layer.parameters() if p.requires_grad]

    def work() -> None:
        value = loss(run_layers(layers, _requires_grad(inputs)), targets)
        if params and value.requires_grad:
            torch.autograd.grad(value, params, allow_unused=True)

    return work


def time_window(work: Callable[[], Any], seconds: float, start: Callable[[], Any] = lambda: None) -> float:
    """Seconds per call of ``work`` run back to back for at least ``seconds``: after a warm-up call
    and ``start()`` (a barrier, so that processes measure at the same time), the calls that ended
    within the window over the time they took (the first call's time if none did). Processes that
    share the window compute together for all of it; a call that runs past it is not counted, as
    the others may have stopped by then."""
    work()
    start()
    begin, ends = time.perf_counter(), []
    while not ends or ends[-1] < seconds:
        work()
        ends.append(time.perf_counter() - begin)
    within = [end for end in ends if end <= seconds]
    return within[-1] / len(within) if within else ends[0]


def time_link(
    transfer: Callable[[Tensor], Any], device: torch.device, sizes: tuple[int, int] = (1 << 14, 1 << 22), repeats: int = 3
) -> LinkProfile:
    """Fit ``latency + bytes / bandwidth`` from timing ``transfer`` on two buffer sizes (float32)."""
    times = {}
    for numel in sizes:
        buffer = torch.zeros(numel, device=device)
        times[numel * 4] = _median_time(lambda: transfer(buffer), device, repeats)
    (small, t_small), (large, t_large) = sorted(times.items())
    slope = max(1e-15, (t_large - t_small) / (large - small))
    return LinkProfile(latency=max(0.0, t_small - slope * small), bytes_per_s=1.0 / slope)


def all_reduce_over(group: dist.ProcessGroup) -> Callable[[Tensor], None]:
    return lambda buffer: dist.all_reduce(buffer, group=group)


def time_pipeline_action(device: torch.device, group: dist.ProcessGroup, repeats: int = 3, micro_batches: int = 8) -> float:
    """Seconds one action of a pipeline schedule (a stage's forward or backward of one micro-batch,
    and its send) costs a stage process beyond its layers, on the path the schedule waits on: a
    pipeline of one layer too small to take time per process of ``group`` (every one of them calls
    this at once), trained over ``micro_batches`` in GPipe's order by the strategy's ``Pipeline``, takes
    ``m + p - 1`` forwards and as many backwards one after another."""
    from lightning_hetero.pipeline import Pipeline, StageModule

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(0)
    layer = nn.Linear(4, 4).to(device)
    inputs, targets = torch.randn(2 * micro_batches, 4, device=device), torch.randn(2 * micro_batches, 4, device=device)

    def loss_fn(output: Tensor, target: Tensor) -> Tensor:
        return (output - target).pow(2).mean()

    pipeline = Pipeline(
        modules=[StageModule([layer], first=rank == 0)], stage_indices=[rank], holders=list(range(size)), device=device, group=group,
        schedule=get_schedule_class("GPipe"), loss_fn=loss_fn,
    )  # fmt: skip
    seconds = _median_time(lambda: pipeline.train_step(inputs, targets, micro_batches, 1.0), device, repeats + 2)
    return seconds / (2 * (micro_batches + size - 1))


def send_along(group: dist.ProcessGroup) -> Callable[[Tensor], Tensor]:
    """A pipeline's send, as its stage processes make them: each sends one message to the next (the
    last to the first) and receives one from the one before, all at once (what it received)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    inbox: dict[int, Tensor] = {}

    def transfer(buffer: Tensor) -> Tensor:
        received = inbox.setdefault(buffer.numel(), torch.empty_like(buffer))
        ops = [
            dist.P2POp(dist.isend, buffer, group=group, group_peer=(rank + 1) % size),
            dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % size),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return received

    return transfer


def gradient_sum_over(group: dist.ProcessGroup, mesh: Optional[LocalMesh] = None) -> Callable[[Tensor], None]:
    """A gradient sum as the strategy does it: gradients packed into a flat buffer, summed,
    averaged, and unpacked (the copies cost as much as the all-reduce on a fast link); over the
    mesh's sockets where the run has one (as ``sync.CoarseSync`` and fine mode's ``sync._Overlap`` sum), else over gloo."""
    staging: dict[int, Tensor] = {}

    def transfer(gradients: Tensor) -> None:
        flat = staging.setdefault(gradients.numel(), torch.empty_like(gradients))
        flat.copy_(gradients)
        sum_over(flat, group, mesh)
        flat.div_(2)
        gradients.copy_(flat)

    return transfer


@dataclass
class EncoderTimes:
    """A multimodal model's costs on one process (``encoder_planner.py``), in seconds per sample."""

    forward: dict[str, float]
    """Each encoder's forward, per sample carrying its modality."""
    backward: dict[str, float]
    """Each encoder's backward, per sample carrying its modality."""
    rest: float
    """The training step's forward and backward less its encoders', per sample of the batch."""
    output_bytes: dict[str, float]
    """Each encoder's output, per sample carrying its modality: what a placed encoder sends."""
    carrying: dict[str, float]
    """The fraction of the batch's samples that carry each modality."""


def time_encoders(module: Any, batch: Any, device: torch.device, repeats: int) -> EncoderTimes:
    """Time a multimodal model's encoders (``modality_encoders``) on ``batch`` on ``device``, and its
    whole training step, forward and backward, leaving no trace: gradients are computed and dropped,
    buffers and the random generators put back, what the step logs is captured and dropped."""
    from lightning_hetero.multimodal import modality_encoders
    from lightning_hetero.results import LogCapture

    batch = move_data_to_device(batch, device)
    size = batch_size_of(batch)
    encoders = modality_encoders(module)
    inputs = {m: x for m, x in module.modality_inputs(batch).items() if x is not None}
    params = [p for p in module.parameters() if p.requires_grad]

    def grads_of(outputs: Tensor, wrt: list[nn.Parameter]) -> None:
        if wrt and outputs.requires_grad:
            torch.autograd.grad(outputs, wrt, torch.ones_like(outputs), allow_unused=True)

    def step() -> None:
        with LogCapture(module, size, size):
            output = module.training_step(batch, 0)
        loss = output["loss"] if isinstance(output, dict) else output
        grads_of(loss, params)

    forward, backward, output_bytes, carrying = {}, {}, {}, {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), kept_buffers([module]):
        for modality, x in inputs.items():
            encoder, rows = encoders[modality], max(1, batch_size_of(x))
            own = [p for p in encoder.parameters() if p.requires_grad]
            with torch.no_grad():
                output = encoder(x)
                fwd = _median_time(lambda: encoder(x), device, repeats)
            both = _median_time(lambda: grads_of(encoder(x), own), device, repeats)
            forward[modality], backward[modality] = fwd / rows, max(0.0, both - fwd) / rows
            output_bytes[modality] = output.numel() * output.element_size() / rows
            carrying[modality] = batch_size_of(x) / size
        whole = _median_time(step, device, repeats)
    encoded = sum((forward[m] + backward[m]) * carrying[m] * size for m in inputs)
    return EncoderTimes(forward, backward, max(0.0, whole - encoded) / size, output_bytes, carrying)
