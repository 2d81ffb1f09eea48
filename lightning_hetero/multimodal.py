"""Multimodal models: each modality's encoder computed on the process that suits it.

A multimodal LightningModule names its encoders by modality and says how a batch gives each its
input (the contract, ``MultimodalModule``)::

    def modality_encoders(self) -> Mapping[str, nn.Module]   # {"image": self.cnn, "text": self.embed}
    def modality_inputs(self, batch) -> Mapping[str, Any]    # each encoder's input for this batch

``modality_inputs(batch)`` gives, for each modality some sample of ``batch`` carries, the input its
encoder is called with: the rows of the samples that carry it, in sample order (a modality no sample
carries is left out, or ``None``). The model's own ``forward`` calls each encoder once per batch,
with exactly that input (``MultimodalModule.encode`` does), and fuses the outputs as it likes.

[Note: placing an encoder]
Every worker of a replica layout holds the whole model and computes its share of every batch. By
default (``"split"``) each computes its own share's encoders, like the rest of the model. An encoder
*placed* on a process (``encoders={"text": "cpu0"}``) is computed there for every worker's share:

1. the host runs the encoder on each other worker's share (every rank holds the whole batch, so only
   the encoder's output travels) and sends each its output, before its own share;
2. each worker runs its own ``training_step``; its call of the placed encoder returns the output the
   host sent (checked to be for the same input), as a leaf that collects its gradient;
3. after its backward, the worker sends that gradient back, and the host runs the encoder's
   backward with it, so the encoder's parameters collect every share's gradient on the host;
4. the gradients are summed over the workers as always (every worker holds every parameter), so
   every parameter is updated exactly as one device would update it.

The encoders placed on different processes run at the same time, and a worker waits for a placed
encoder only where its ``forward`` calls it. Sends are non-blocking and every rank receives in the
order above (features before its own step, gradients after it), so two hosts that use each other's
encoders cannot wait on each other. Where the CPU workers have no share of a batch, a CPU worker
that hosts an encoder still computes it, and takes part in the step's sum.

In a pipeline of several stages, an encoder is placed on a CPU worker (which holds the whole model)
and the stage whose blocks hold it is the one that calls it: the CPU worker encodes the pipeline's
share, and the stage's calls, one per micro-batch, take its rows in turn (``micro_batch``); its
gradient, accumulated over the micro-batches, goes back after the schedule.

Placement changes where the encoders run, never the maths: ``set_placement`` may change it at any
batch (on every rank alike). Evaluation steps compute every encoder where its worker runs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Generator, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._pytree import tree_flatten

from lightning_hetero.record import StepClock, span
from lightning_hetero.shares import Shares, batch_size_of, slice_batch

__all__ = [
    "MultimodalModule",
    "SPLIT",
    "modality_encoders",
    "offers_modalities",
    "check_placement",
    "check_encoder_placement",
    "unplaceable_encoders",
    "modality_rows",
    "encoder_stages",
    "EncoderExchange",
    "EncoderPacing",
    "carrying",
    "micro_batch",
    "in_backward",
]

SPLIT = "split"
"""An encoder computed by every worker on its own share (the default)."""

_HOST = re.compile(r"^(cpu|device|replica|stage)(\d*)$")
_HEADER = 10  # ndim, dtype, then up to 8 dimensions
WIRE_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool]
"""The dtypes a tensor sent between processes may have, by the code its header carries (``pipeline.py`` too)."""


class MultimodalModule:
    """A mixin for multimodal LightningModules (see the module's doc): ``encode(batch)`` computes every
    encoder whose modality the batch carries, on its input, for the model's ``forward`` to fuse."""

    def modality_encoders(self) -> Mapping[str, nn.Module]:
        raise NotImplementedError(f"`{type(self).__name__}` must define `modality_encoders()`.")

    def modality_inputs(self, batch: Any) -> Mapping[str, Any]:
        raise NotImplementedError(f"`{type(self).__name__}` must define `modality_inputs(batch)`.")

    def encode(self, batch: Any) -> dict[str, Tensor]:
        """Each present modality's encoder output for ``batch``: ``{modality: encoder(input)}``."""
        encoders = self.modality_encoders()
        return {name: encoders[name](x) for name, x in self.modality_inputs(batch).items() if x is not None}


def offers_modalities(model: nn.Module) -> bool:
    """Whether the model names encoders by modality (``modality_encoders``)."""
    return callable(getattr(model, "modality_encoders", None))


def modality_encoders(model: nn.Module) -> dict[str, nn.Module]:
    """The model's encoders by modality, checked: modules of the model, with parameters of their own
    (no parameter in two encoders), and a ``modality_inputs``; ``{}`` for a model that names none."""
    if not offers_modalities(model):
        return {}
    name = type(model).__name__
    if not callable(getattr(model, "modality_inputs", None)):
        raise TypeError(
            f"`{name}` names encoders by modality (`modality_encoders()`) but has no `modality_inputs(batch)`"
            " giving each encoder its input for a batch; add it (see `lightning_hetero.MultimodalModule`)."
        )
    encoders = model.modality_encoders()
    if not isinstance(encoders, Mapping) or not encoders:
        raise TypeError(f"`{name}.modality_encoders()` must return a mapping of modality names to encoders.")
    modules = {id(m) for m in model.modules()}
    owners: dict[int, str] = {}
    for modality, encoder in encoders.items():
        if not isinstance(modality, str) or not isinstance(encoder, nn.Module) or id(encoder) not in modules:
            raise TypeError(
                f"`{name}.modality_encoders()` maps {modality!r} to {type(encoder).__name__}: each modality's"
                " name must be a string and its encoder a submodule of the model."
            )
        for p in encoder.parameters():
            if id(p) in owners:
                raise ValueError(
                    f"Encoders {owners[id(p)]!r} and {modality!r} of `{name}` share a parameter; an encoder's"
                    " parameters must be its own (its gradient is computed where it is placed)."
                )
            owners[id(p)] = modality
    return dict(encoders)


def modality_rows(model: nn.Module, batch: Any) -> dict[str, int]:
    """The samples of ``batch`` that carry each modality ``modality_inputs`` gives for it."""
    return {m: batch_size_of(x) for m, x in model.modality_inputs(batch).items() if x is not None}  # type: ignore[operator]


def carrying(model: nn.Module, batch: Any) -> dict[str, float]:
    """The fraction of ``batch``'s samples that carry each of the model's modalities (``modality_inputs``)."""
    size, rows = batch_size_of(batch), modality_rows(model, batch)
    return {m: rows.get(m, 0) / size for m in modality_encoders(model)}


def check_placement(encoders: Optional[Mapping[str, str]]) -> dict[str, str]:
    """``HeteroStrategy(encoders=...)`` in its form: modality name to ``"split"``, ``"cpuN"`` or
    ``"deviceN"`` (also as the logs name a device's process: ``"replicaN"``, ``"stageN"``; ``"cpu"``
    and ``"device"`` are the first of each); ``"split"`` entries dropped."""
    if encoders is None:
        return {}
    if not isinstance(encoders, Mapping):
        raise ValueError(
            f"`encoders={encoders!r}` must map modality names to where their encoder runs: 'split' (every worker"
            " its own share), 'cpu0' (a CPU worker, for every share) or 'device0' (a device's process)."
        )
    placement = {}
    for modality, host in encoders.items():
        match = _HOST.match(host) if isinstance(host, str) else None
        if host != SPLIT and match is None:
            raise ValueError(
                f"`encoders[{modality!r}]={host!r}` is not a place: use 'split' (every worker encodes its own"
                " share), 'cpuN' (CPU worker N encodes every share) or 'deviceN' (the process of device N does)."
            )
        if host != SPLIT:
            assert match is not None
            kind = "cpu" if match.group(1) == "cpu" else "device"
            placement[str(modality)] = f"{kind}{match.group(2) or 0}"
    return placement


def unplaceable_encoders(model: nn.Module, whole_batch_norm: bool = False) -> dict[str, str]:
    """The model's encoders that cannot be placed on one process, by modality: why each must stay split.
    ``whole_batch_norm``: ``Trainer(sync_batchnorm=True)``, whose BatchNorm is a collective of every worker."""
    name = type(model).__name__
    reasons = {}
    for modality, encoder in modality_encoders(model).items():
        shared = _used_outside(model, encoder)
        norms = [type(m).__name__ for m in encoder.modules() if isinstance(m, _NormBase)]
        stats = [type(m).__name__ for m in encoder.modules() if isinstance(m, _NormBase) and m.track_running_stats]
        if shared:
            reasons[modality] = (
                f"Encoder {modality!r} shares parameter {shared!r} with the rest of `{name}` (tied weights): its"
                " gradient would come from two processes. Leave it 'split', or untie the weight."
            )
        elif stats:
            reasons[modality] = (
                f"Encoder {modality!r} has {stats[0]} with running statistics, which would be updated once per share"
                " on the process it is placed on; leave it 'split' or use `track_running_stats=False`."
            )
        elif norms and whole_batch_norm:
            reasons[modality] = (
                f"Encoder {modality!r} has {norms[0]}, whose statistics `Trainer(sync_batchnorm=True)` computes over"
                " the whole batch, together with every worker; placed, its host would compute it for the others'"
                " shares alone. Leave it 'split', or set `sync_batchnorm=False` (each share's statistics)."
            )
    return reasons


def check_encoder_placement(
    model: nn.Module,
    placement: Mapping[str, str],
    cpu_workers: int,
    devices: int,
    replicas: bool,
    whole_batch_norm: bool = False,
) -> None:
    """Raise a clear error where ``placement`` cannot run for ``model`` on this layout (and where its
    encoders break the contract, placed or not: every process checks that as it starts);
    ``whole_batch_norm``: ``Trainer(sync_batchnorm=True)`` (``unplaceable_encoders``)."""
    if not placement:
        modality_encoders(model)
        return
    name = type(model).__name__
    encoders = modality_encoders(model)
    if not encoders:
        raise ValueError(
            f"`encoders={dict(placement)}` places encoders, but `{name}` names none: give it"
            " `modality_encoders()` and `modality_inputs(batch)` (see `lightning_hetero.MultimodalModule`)."
        )
    for modality, host in placement.items():
        if modality not in encoders:
            raise ValueError(f"`encoders` places {modality!r}, but `{name}` has encoders {sorted(encoders)} only.")
        kind, index = _HOST.match(host).groups()  # type: ignore[union-attr]  (checked: cpuN or deviceN)
        if kind == "device" and not replicas and devices > 1:
            raise ValueError(
                f"`encoders[{modality!r}]={host!r}`: this layout cuts the model into {devices} pipeline stages, and a"
                " stage holds only its own blocks; place an encoder on a CPU worker ('cpu0'), which holds the whole"
                " model, or use `parallelism='replicas'`."
            )
        count = cpu_workers if kind == "cpu" else devices
        if int(index) >= count:
            raise ValueError(
                f"`encoders[{modality!r}]={host!r}`: this layout has {count} {'CPU worker' if kind == 'cpu' else 'device'}"
                f" process(es) ({kind}0 to {kind}{count - 1})." if count else
                f"`encoders[{modality!r}]={host!r}`: this layout has no {'CPU worker' if kind == 'cpu' else 'device'}."
            )
    unplaceable = unplaceable_encoders(model, whole_batch_norm)
    for modality in placement:
        if modality in unplaceable:
            raise ValueError(unplaceable[modality])


def encoder_stages(
    model: nn.Module,
    placement: Mapping[str, str],
    layers: Sequence[nn.Module],
    bounds: Sequence[tuple[int, int]],
    strict: bool = True,
) -> dict[str, int]:
    """The pipeline stage whose blocks hold each placed encoder (the one that calls it); raise where an
    encoder's parameters are not all in one stage's blocks (``strict``; otherwise leave it out)."""
    encoders = modality_encoders(model)
    found = {}
    for modality in placement:
        params = {id(p) for p in encoders[modality].parameters()}
        stages = [
            s for s, (start, stop) in enumerate(bounds)
            if params & {id(p) for layer in layers[start:stop] for p in layer.parameters()}
        ]  # fmt: skip
        if len(stages) != 1 and not strict:
            continue
        if len(stages) != 1:
            where = f"stages {stages}" if stages else "no stage's blocks"
            raise ValueError(
                f"Encoder {modality!r} of `{type(model).__name__}` is in {where}: a placed encoder must be inside the"
                " blocks of one pipeline stage (which calls it). Cut the stages elsewhere, or leave it 'split'."
            )
        found[modality] = stages[0]
    return found


def _used_outside(model: nn.Module, encoder: nn.Module) -> Optional[str]:
    """The name of a parameter of ``encoder`` that the model also holds outside it (a tied weight), or None."""
    paths = [name for name, module in model.named_modules(remove_duplicate=False) if module is encoder]
    own = {id(p) for p in encoder.parameters()}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in own and not any(name.startswith(f"{path}.") for path in paths):
            return name
    return None


@dataclass
class _Hosted:
    """An encoder output this rank computed for another worker, kept for that worker's gradient."""

    rank: int
    tag: int
    output: Tensor
    modality: str


@dataclass
class _Received:
    """An encoder output this rank received for its own share (a leaf that collects its gradient)."""

    rank: int
    tag: int
    leaf: Optional[Tensor] = None
    offset: int = 0
    """The rows of ``leaf`` the step has used so far."""


class EncoderExchange:
    """This rank's part in placed encoders (see the module's note): what it computes for the other
    workers, and the outputs it receives for its own share.

    Args:
        module: the whole model on this rank.
        hosts: each place (``"cpu0"``, ``"device1"``) of this node: its global rank.
        ranges: each worker of this node that computes training samples: its place, and its samples
            of a batch given the step's ``Shares``.
        me: this rank's place.
        consumes: the modalities each place calls the encoder of, where not all (a pipeline stage calls
            only the encoders in its blocks).
        group: the node's ranks, on gloo, for these sends and receives alone.
        device: this rank's device.
    """

    def __init__(
        self,
        module: nn.Module,
        hosts: Mapping[str, int],
        ranges: Sequence[tuple[str, Callable[[Shares], tuple[int, int]]]],
        me: str,
        group: dist.ProcessGroup,
        device: torch.device,
        consumes: Optional[Mapping[str, set[str]]] = None,
    ) -> None:
        self.module = module
        self.encoders = modality_encoders(module)
        self.placement: dict[str, str] = {}
        self._tags = {name: 2 * i for i, name in enumerate(sorted(self.encoders))}
        self._hosts = dict(hosts)
        self._ranges = list(ranges)
        self.me = me
        self._group = group
        self._device = device
        self._hosted: list[_Hosted] = []
        self._received: list[_Received] = []
        self._sent: list[Any] = []
        self._clock: Optional[StepClock] = None
        self._consumes = dict(consumes or {})
        self._pipelined = False

    def set_placement(self, placement: Mapping[str, str]) -> None:
        """Place the encoders so from the next training batch on (every rank alike)."""
        self.placement = dict(placement)

    @property
    def on_cpu_worker(self) -> bool:
        """Whether some encoder is placed on a CPU worker (which then computes in every step)."""
        return any(host.startswith("cpu") for host in self.placement.values())

    def _inputs(self, share: Any) -> Mapping[str, Any]:
        inputs = self.module.modality_inputs(share)  # type: ignore[operator]
        if not isinstance(inputs, Mapping):
            raise TypeError(
                f"`{type(self.module).__name__}.modality_inputs(batch)` must return a mapping of modality names to"
                f" encoder inputs; got {type(inputs).__name__}."
            )
        return {k: v for k, v in inputs.items() if v is not None}

    def _work(self, batch: Any, shares: Shares) -> list[tuple[str, str, int, Any]]:
        """(modality, consumer's place, consumer's rank, its encoder input) for each encoder output
        this rank computes for another worker in this step."""
        hosted = [m for m, host in self.placement.items() if host == self.me]
        if not hosted:
            return []
        work = []
        for place, samples in self._ranges:
            start, stop = samples(shares)
            if place == self.me or start == stop:
                continue
            inputs = self._inputs(slice_batch(batch, start, stop))
            work += [(m, place, self._hosts[place], inputs[m]) for m in hosted if m in inputs and self._calls(place, m)]
        return work

    def _calls(self, place: str, modality: str) -> bool:
        """Whether the worker at ``place`` calls the encoder of ``modality`` in its step."""
        return place not in self._consumes or modality in self._consumes[place]

    def extra_arrivals(self, batch: Any, shares: Shares, own: int) -> dict[nn.Parameter, int]:
        """Gradients each encoder parameter receives in this step's backward where that differs from
        ``own`` (the count every other parameter receives): on the host, its own share's (where it
        carries the modality) and one for every share it computes for others; none on a worker whose
        encoder runs elsewhere (fine mode's count)."""
        hosted = {m for m, _, _, _ in self._work(batch, shares)}
        mine = {}
        for place, samples in self._ranges:
            start, stop = samples(shares)
            if place == self.me and start < stop:
                mine = self._inputs(slice_batch(batch, start, stop))
        extra = {}
        for m, encoder in self.encoders.items():
            host = self.placement.get(m, SPLIT)
            if host == SPLIT:
                continue
            # The host's own step calls the encoder where its share carries the modality; its backward
            # for every other share is one backward pass (``backward_for_others``).
            arrivals = (own if m in mine else 0) + (1 if m in hosted else 0) if host == self.me else 0
            extra.update({p: arrivals for p in encoder.parameters()})
        return extra

    # ------------------------------------------------------------ one training step

    def forward_for_others(self, batch: Any, shares: Shares, clock: Optional[StepClock] = None) -> None:
        """Step 1: compute each encoder placed here on every other worker's share, and send it (timed
        as ``"encoder <modality>"``)."""
        self._hosted, self._clock = [], clock
        for modality, _, rank, inputs in self._work(batch, shares):
            with span(clock, f"encoder {modality}"):
                output = self.encoders[modality](move_data_to_device(inputs, self._device))
            if not isinstance(output, Tensor):
                raise TypeError(
                    f"Encoder {modality!r} returned a {type(output).__name__}; an encoder placed on another process"
                    " must return one tensor (wrap it to return the tensor the model fuses)."
                )
            tag = self._tags[modality]
            self._send(_header(output), rank, tag)
            self._send(output.detach(), rank, tag)
            self._hosted.append(_Hosted(rank, tag + 1, output, modality))

    @contextmanager
    def receiving(self, share: Any, clock: Optional[StepClock] = None, pipelined: bool = False) -> Generator[None, None, None]:
        """Step 2, around this rank's own step on ``share``: each encoder placed elsewhere answers with
        the output its host sent for this share. ``pipelined``: a pipeline stage's, which calls it once per
        micro-batch, each with its rows in turn, inside ``micro_batch()``; a call outside one (the stage
        inferring its shapes) gets rows of zeros of the same shape."""
        self._pipelined = pipelined
        remote = {m: host for m, host in self.placement.items() if host != self.me and self._calls(self.me, m)}
        hosted = [m for m, host in self.placement.items() if host == self.me]
        if clock is not None:
            self._clock = clock
        inputs = self._inputs(share) if remote else {}
        self._received = []
        # A forward of the instance's own (a wrapper's) is the encoder's again afterwards.
        own = {m: vars(self.encoders[m]).get("forward") for m in [*remote, *hosted]}
        # The host ran the encoder's hooks on the output it sent: here its call only answers with it.
        hooks = {m: _take_hooks(self.encoders[m]) for m in remote}
        for modality in remote:
            received = _Received(self._hosts[remote[modality]], self._tags[modality])
            expected = inputs.get(modality)
            if expected is not None:
                self._received.append(received)
            self.encoders[modality].forward = self._answer(modality, expected, received)  # type: ignore[method-assign]
        for modality in hosted:
            self.encoders[modality].forward = self._checked(modality, self.encoders[modality].forward)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for modality, forward in own.items():
                if forward is None:
                    del self.encoders[modality].forward
                else:
                    self.encoders[modality].forward = forward  # type: ignore[method-assign]
            for modality, taken in hooks.items():
                _put_back_hooks(self.encoders[modality], taken)

    def _check_call(self, modality: str, args: tuple, kwargs: dict) -> None:
        """What every process (the host too, on its own share) asks of a call of a placed encoder: one
        input, as its host computes it for the others."""
        if kwargs or len(args) != 1:
            raise RuntimeError(
                f"`{type(self.module).__name__}` called encoder {modality!r} with {len(args)} positional and"
                f" {len(kwargs)} keyword argument(s); a placed encoder is called with one input,"
                f" `modality_inputs(batch)[{modality!r}]`, which its host computes it on."
            )

    def _checked(self, modality: str, forward: Callable[..., Tensor]) -> Callable[..., Tensor]:
        """The host's own ``forward`` of an encoder it computes for the others, called as they call it."""

        def checked(*args: Any, **kwargs: Any) -> Tensor:
            self._check_call(modality, args, kwargs)
            return forward(*args, **kwargs)

        return checked

    def _answer(self, modality: str, expected: Any, received: _Received) -> Callable[..., Tensor]:
        """The placed encoder's ``forward`` on this rank: the rows of the output its host sent, in the
        order they are asked for (the whole share at once, or a pipeline's micro-batches in turn); a
        call on meta tensors (a pipeline stage inferring its shapes) gets meta rows of the same shape."""
        model = type(self.module).__name__
        rows = batch_size_of(expected) if expected is not None else 0

        def forward(*args: Any, **kwargs: Any) -> Tensor:
            if expected is None:
                raise RuntimeError(
                    f"`{model}` called encoder {modality!r} on a share of the batch for which `modality_inputs` gives"
                    f" no {modality!r} input; call each encoder only on the inputs `modality_inputs(batch)` gives."
                )
            if _IN_BACKWARD.get():
                raise RuntimeError(
                    f"`{model}` called encoder {modality!r} again during the backward (activation checkpointing"
                    " recomputes it there); a placed encoder's output comes from another process once per step."
                    " Leave this encoder 'split', or checkpoint only modules that do not call it."
                )
            self._check_call(modality, args, kwargs)
            given = args[0]
            count = batch_size_of(given)
            if received.leaf is None:
                received.leaf = _trainable(self._receive(received))
            start = received.offset
            if _on_meta(given) or (self._pipelined and not _IN_MICRO_BATCH.get()):
                rows_of = received.leaf[start : start + count].detach()
                return _trainable(torch.zeros_like(rows_of, device=rows_of.device if not _on_meta(given) else "meta"))
            if start + count > rows or not _same(given, slice_batch(expected, start, start + count)):
                raise RuntimeError(
                    f"`{model}` called encoder {modality!r} with another input than `modality_inputs(batch)[{modality!r}]`"
                    " for its batch (or more than once); the encoder is placed on another process, which computes it"
                    " on exactly that input, of the batch as the step method receives it. Call it once per batch as"
                    " `encoder(self.modality_inputs(batch)[name])` (or use `self.encode(batch)`), and change the"
                    " batch before the step, not in it (`on_after_batch_transfer`, or the DataLoader's transform)."
                )
            received.offset += count
            return received.leaf[start : start + count]

        forward.answered = True  # type: ignore[attr-defined]
        return forward

    def send_gradients(self) -> None:
        """Step 3, after this rank's backward: each received output's gradient goes back to its host (an
        output the step never used is received and answered with zeros)."""
        for received in self._received:
            if received.leaf is None:
                received.leaf = self._receive(received)
            grad = received.leaf.grad if received.leaf.grad is not None else torch.zeros_like(received.leaf)
            self._send(grad.detach(), received.rank, received.tag + 1)
        self._received = []

    def backward_for_others(self) -> None:
        """Step 3, on the host: the encoders' backward with every other worker's gradient of their output."""
        if not self._hosted:
            return
        grads = []
        for hosted in self._hosted:
            grad = self._host_buffer(hosted.output.shape, hosted.output.dtype)
            with span(self._clock, "encoder wait"):
                dist.recv(grad, hosted.rank, group=self._group, tag=hosted.tag)
            grads.append(grad.to(hosted.output.device, non_blocking=True))
        kinds = {f"encoder {h.modality}" for h in self._hosted}
        # A frozen encoder's output has no graph: its gradients are received (to keep the messages in
        # step) and dropped.
        pairs = [(h.output, g) for h, g in zip(self._hosted, grads) if h.output.requires_grad]
        if pairs:
            with span(self._clock, kinds.pop() if len(kinds) == 1 else "encoders"), in_backward():
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self._hosted = []

    def finish(self) -> None:
        """Wait until what this rank sent in the step has been delivered."""
        for work in self._sent:
            work.wait()
        self._sent = []

    def abort(self) -> None:
        self._hosted, self._received, self._sent = [], [], []

    def _send(self, tensor: Tensor, rank: int, tag: int) -> None:
        self._sent.append(dist.isend(_on_host(tensor), rank, group=self._group, tag=tag))

    def _receive(self, received: _Received) -> Tensor:
        """An output sent by its host; the time waiting for it is ``"encoder wait"``."""
        with span(self._clock, "encoder wait"):
            header = torch.empty(_HEADER, dtype=torch.int64)
            dist.recv(header, received.rank, group=self._group, tag=received.tag)
            ndim, dtype = int(header[0]), WIRE_DTYPES[int(header[1])]
            buffer = self._host_buffer([int(d) for d in header[2 : 2 + ndim]], dtype)
            dist.recv(buffer, received.rank, group=self._group, tag=received.tag)
        return buffer.to(self._device, non_blocking=True)

    def _host_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """Where a message lands: pinned memory where it goes on to a GPU, so the copy runs asynchronously."""
        return torch.empty(shape, dtype=dtype, pin_memory=self._device.type == "cuda")


_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _no_hook(*args: Any) -> None:
    """A hook's place while it is taken off: it changes nothing."""


def _take_hooks(module: nn.Module) -> dict[str, Any]:
    """Take ``module``'s own forward and backward hooks off it, for ``_put_back_hooks``. Each keeps its
    place (and its handle), holding a hook that changes nothing meanwhile, so that a handle removed
    meanwhile removes it for good."""
    taken = {}
    for name in _HOOKS:
        hooks = vars(module).get(name)
        if hooks:
            taken[name] = dict(hooks)
            for key in hooks:
                hooks[key] = _no_hook
    return taken


def _put_back_hooks(module: nn.Module, taken: dict[str, Any]) -> None:
    """The hooks ``_take_hooks`` took, where they still are (not removed since)."""
    for name, held in taken.items():
        hooks = vars(module)[name]
        for key, hook in held.items():
            if hooks.get(key) is _no_hook:
                hooks[key] = hook


def _on_host(tensor: Tensor) -> Tensor:
    """A tensor gloo can send: itself on the CPU; from a GPU, copied to pinned memory (gloo sends CPU
    tensors only), the copy finished before the send reads it."""
    if tensor.device.type != "cuda":
        return tensor.contiguous()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host


def _header(output: Tensor) -> Tensor:
    if output.dtype not in WIRE_DTYPES or output.dim() > _HEADER - 2:
        raise TypeError(f"An encoder output of {output.dtype} with {output.dim()} dimensions cannot be sent.")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[: 2 + output.dim()] = torch.tensor([output.dim(), WIRE_DTYPES.index(output.dtype), *output.shape])
    return header


_IN_MICRO_BATCH: ContextVar[bool] = ContextVar("hetero_in_micro_batch", default=False)
_IN_BACKWARD: ContextVar[bool] = ContextVar("hetero_in_backward", default=False)


@contextmanager
def in_backward() -> Generator[None, None, None]:
    """Marks a worker's backward (its own share's, or a pipeline stage's of one micro-batch): a placed
    encoder called in it is being recomputed, which it cannot be. The backward runs outside the
    forward's autocast (mixed precision), as Lightning runs it: the step methods run inside it."""
    token = _IN_BACKWARD.set(True)
    try:
        with ExitStack() as outside:
            for device_type in ("cpu", "cuda"):
                if torch.is_autocast_enabled(device_type):
                    outside.enter_context(torch.autocast(device_type, enabled=False))
            yield
    finally:
        _IN_BACKWARD.reset(token)


@contextmanager
def micro_batch() -> Generator[None, None, None]:
    """Marks a pipeline stage's forward of one micro-batch (``pipeline.py``): a placed encoder called in
    it answers with the micro-batch's rows of its output."""
    token = _IN_MICRO_BATCH.set(True)
    try:
        yield
    finally:
        _IN_MICRO_BATCH.reset(token)


def _on_meta(value: Any) -> bool:
    return any(isinstance(x, Tensor) and x.is_meta for x in tree_flatten(value)[0])


def _trainable(output: Tensor) -> Tensor:
    """A placed encoder's received output, as a leaf the model's backward gives a gradient to where
    it can carry one (an encoder that outputs codes, integers or bools, gets none)."""
    return output.requires_grad_() if output.is_floating_point() or output.is_complex() else output


def _same(given: Any, expected: Any) -> bool:
    """Whether two encoder inputs are the same: structure, and every tensor equal."""
    a, spec_a = tree_flatten(given)
    b, spec_b = tree_flatten(expected)
    if spec_a != spec_b:
        return False
    for x, y in zip(a, b):
        if isinstance(x, Tensor) != isinstance(y, Tensor):
            return False
        if isinstance(x, Tensor):
            y = y.to(x.device)
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if not (torch.equal(x, y) or (x.is_floating_point() and torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num()))):
                return False  # a NaN is the same NaN: the step's check of non-finite values reports it
        elif x != y:
            return False
    return True


class EncoderPacing:
    """TESTING ONLY: emulated encoder speeds (the strategy's ``emulated_speed``, ``"<modality>@cpu"`` on a
    CPU worker, ``"<modality>@device"`` on a device's process): each encoder's forward on this process
    takes at least ``rows / speed`` seconds, as on a device of that speed, whether it runs for its own
    share or for another worker's (an output answered from elsewhere is not paced here)."""

    def __init__(self, module: nn.Module, kind: str) -> None:
        self.encoders = modality_encoders(module)
        self.kind = kind
        self._seconds: dict[str, float] = {}
        self._hooks: dict[str, tuple[Any, Any]] = {}
        self._started: list[float] = []

    def set(self, speeds: Mapping[str, float]) -> None:
        suffix = f"@{self.kind}"
        self._seconds = {k[: -len(suffix)]: 1.0 / v for k, v in speeds.items() if k.endswith(suffix) and v}
        for modality, encoder in self.encoders.items():
            if modality in self._seconds and modality not in self._hooks:
                self._hooks[modality] = (
                    encoder.register_forward_pre_hook(lambda *_: self._started.append(time.perf_counter())),
                    encoder.register_forward_hook(partial(self._pad, modality)),
                )
            elif modality not in self._seconds and modality in self._hooks:
                for handle in self._hooks.pop(modality):
                    handle.remove()

    def _pad(self, modality: str, encoder: nn.Module, args: Any, output: Any) -> None:
        started = self._started.pop()
        answered = getattr(encoder.__dict__.get("forward"), "answered", False)
        if answered or not isinstance(output, Tensor) or modality not in self._seconds:
            return  # an output computed elsewhere, answered here
        rest = len(output) * self._seconds[modality] - (time.perf_counter() - started)
        if rest > 0:
            time.sleep(rest)
