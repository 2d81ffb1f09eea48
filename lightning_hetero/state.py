"""Model and optimizer state when stages hold only their slice of the layers.

A stage rank keeps its own layers on its device and the others on the ``meta`` device (shape
only, no memory). In fine mode, offloaded buckets keep their optimizer state outside the
optimizer; checkpoints still hold every parameter's state in torch's ordinary format.

A CPU worker that had no share of the last optimizer steps kept out of their gradient sums, so
its replica is stale (parameters, buffers, optimizer state); ``refresh_replicas`` brings it up to date from the stages before it is
used again (a share of a batch, a checkpoint, the end of training). Where a CPU worker exists, global rank 0 is one and holds the whole model and
optimizer state, so checkpoints need nothing from here. Without a CPU worker, rank 0 is stage 0,
and these helpers gather the stages' slices into one ordinary state dict, keyed exactly as a
single-process model's, which a plain ``Trainer`` loads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn
from torch.optim import Optimizer

from lightning_hetero.offload import BucketStep, OffloadStep, param_index
from lightning_hetero.topology import gather_object_to

if TYPE_CHECKING:
    from lightning_hetero.workers import Placement

__all__ = [
    "refresh_replicas",
    "gather_module_state",
    "gather_optimizer_state",
    "move_materialized",
    "drop_to_meta",
    "fill_from_peers",
    "with_offloaded_state",
    "load_with_offloaded_state",
]


def move_materialized(module: nn.Module, device: torch.device) -> None:
    """Move every tensor of ``module`` that is not on the meta device to ``device``."""
    module._apply(lambda t: t if t.is_meta else t.to(device))


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` under every name it has (shared ones more than once)."""
    params = module.named_parameters(remove_duplicate=False)
    return [*params, *module.named_buffers(remove_duplicate=False)]


def drop_to_meta(layers: Sequence[nn.Module], keep: Sequence[torch.Tensor] = ()) -> None:
    """Move the parameters and buffers of ``layers`` to the meta device (shapes only, no memory):
    another rank holds their values. Those in ``keep`` (this rank's own, which a dropped layer may
    share: tied weights) stay; a tensor under several names stays one tensor, so the model's
    parameters keep their number and order."""
    kept = {id(t) for t in keep}
    dropped: dict[int, torch.Tensor] = {}
    for layer in layers:
        for module in layer.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is None or t.is_meta or id(t) in kept:
                        continue
                    if id(t) not in dropped:
                        meta = t.detach().to("meta")
                        dropped[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
                    table[name] = dropped[id(t)]


def fill_from_peers(module: nn.Module, send: bool, group: dist.ProcessGroup) -> None:
    """Give every tensor of ``module`` on the meta device the value a peer holds (a collective over
    ``group``; the ranks with ``send`` share their materialized tensors): after it, every rank holds
    the whole model, the filled tensors on the CPU. A tensor under several names (tied weights)
    stays one tensor."""
    mine = {name: t.detach().cpu() for name, t in _tensors(module) if send and not t.is_meta}
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    values = {name: value for part in parts for name, value in part.items()}
    filled: dict[int, torch.Tensor] = {}
    for name, tensor in _tensors(module):
        if not tensor.is_meta or name not in values and id(tensor) not in filled:
            continue
        if id(tensor) not in filled:
            value = values[name].to(tensor.dtype)
            is_param = isinstance(tensor, nn.Parameter)
            filled[id(tensor)] = nn.Parameter(value, requires_grad=tensor.requires_grad) if is_param else value
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner)
        table = sub._parameters if leaf in sub._parameters else sub._buffers
        table[leaf] = filled[id(tensor)]


def gather_module_state(module: nn.Module, group: dist.ProcessGroup) -> dict[str, Any]:
    """The full ``state_dict`` on rank 0 (an empty dict elsewhere), from every rank's materialized
    entries; names of one tensor (tied weights) share one there too."""
    local = module.state_dict()
    mine = {k: v.detach().cpu() for k, v in local.items() if not (torch.is_tensor(v) and v.is_meta)}
    parts = _gather(mine, group)
    if parts is None:
        return {}
    # A tensor under several names (tied weights) is one tensor in the state dict, as in one process.
    first: dict[int, str] = {}
    alias = {name: first.setdefault(id(t), name) for name, t in _tensors(module)}
    values: dict[str, Any] = {}
    for key in local:
        name = alias.get(key, key)
        if name not in values:
            values[name] = next(part[name] for part in parts if name in part)
    return {key: values[alias.get(key, key)] for key in local}


def gather_optimizer_state(local: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """The full optimizer ``state_dict`` on rank 0 (empty elsewhere), from each rank's ``local``
    one, which holds the state of that rank's own parameters."""
    parts = _gather(move_data_to_device(local["state"], "cpu"), group)
    if parts is None:
        return {}
    state = {}
    for part in parts:
        state.update(part)
    return {"state": dict(sorted(state.items())), "param_groups": local["param_groups"]}


def _gather(obj: Any, group: dist.ProcessGroup) -> list[Any] | None:
    return gather_object_to(obj, dist.get_global_rank(group, 0), group)


def with_offloaded_state(optimizer: Optimizer, steps: Sequence[BucketStep]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with the state of offloaded buckets filled in, as if the
    optimizer had stepped every parameter itself: an ordinary torch optimizer state dict."""
    state_dict = optimizer.state_dict()
    index = param_index(optimizer)
    for step in steps:
        if isinstance(step, OffloadStep):
            for p, state in step.state().items():
                state_dict["state"][index[p][1]] = state
    state_dict["state"] = dict(sorted(state_dict["state"].items()))
    return state_dict


def load_with_offloaded_state(optimizer: Optimizer, state_dict: dict[str, Any], steps: Sequence[BucketStep]) -> None:
    """Load an ordinary optimizer state dict: offloaded buckets take their parameters' state, the
    optimizer the rest (only for parameters this rank holds; others live on the meta device)."""
    by_position = {position: p for p, (_, position) in param_index(optimizer).items()}
    # A bucket split between the CPU workers takes every parameter's state, and keeps its own part.
    offloaded = {p: step for step in steps if isinstance(step, OffloadStep) for p in getattr(step, "bucket_params", step.params)}
    mine, theirs = {}, {}
    for position, state in state_dict["state"].items():
        p = by_position[int(position)]
        if p in offloaded:
            theirs.setdefault(offloaded[p], {})[p] = state
        elif not p.is_meta:
            mine[position] = state
    optimizer.load_state_dict({"state": mine, "param_groups": state_dict["param_groups"]})
    for step, states in theirs.items():
        step.load_state(states)



def refresh_replicas(
    is_cpu_worker: bool,
    placement: "Placement",
    module: nn.Module,
    versions: Mapping[int, int],
    optimizer: Optional[Optimizer],
    steps: Sequence[BucketStep],
) -> None:
    """Every stage sends its parameters, the buffers it changed since the trainer call began (the
    steps the CPU workers kept out of wrote them: a step counter, spectral norm's vectors, BatchNorm's
    statistics; ``versions``: each buffer's version then, by ``id``, where constant ones such as a
    causal mask keep theirs) and its parameters' optimizer state to the CPU workers, which take them
    into their replica (a collective over each stage's sync group, on every member)."""
    gathered: dict[int, Any] = {}
    for s, group in enumerate(placement.sync_groups):
        if group is None:
            continue
        src = placement.stage_ranks[s]
        params = placement.stage_params(s)
        if params:
            flat = torch.cat([p.detach().reshape(-1).cpu() for p in params]) if not is_cpu_worker else None
            if flat is None:
                flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype)
            dist.broadcast(flat, src=src, group=group)
            if is_cpu_worker:
                with torch.no_grad():
                    offset = 0
                    for p in params:
                        p.copy_(flat[offset : offset + p.numel()].view_as(p))
                        offset += p.numel()
        buffers = placement.stage_buffers(s, module)
        mine = None
        if not is_cpu_worker:
            state = with_offloaded_state(optimizer, steps)["state"] if optimizer is not None else None
            changed = {i: b.detach() for i, b in enumerate(buffers) if b._version != versions.get(id(b))}
            mine = move_data_to_device((state, changed), "cpu")
        box = [mine]
        dist.broadcast_object_list(box, src=src, group=group)
        if is_cpu_worker:
            state, changed = box[0]
            gathered.update(state or {})
            with torch.no_grad():
                for i, value in changed.items():
                    buffers[i].copy_(value)
    if is_cpu_worker and optimizer is not None:
        state = {"state": gathered, "param_groups": optimizer.state_dict()["param_groups"]}
        load_with_offloaded_state(optimizer, state, steps)
