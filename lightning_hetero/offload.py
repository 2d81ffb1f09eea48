"""Where one bucket's optimizer step runs: on the stage's device, or offloaded to the CPU.

Fine mode steps the optimizer one bucket at a time, while the backward pass is still busy with
earlier layers. Both kinds of step below apply the user's own optimizer (class, parameter
groups, hyperparameters, learning-rate schedule) to one bucket's parameters:

- ``DeviceStep`` runs the user's optimizer restricted to the bucket, on the parameters' device.
  It shares the user optimizer's per-parameter state, so that state lives where it always does.
- ``OffloadStep`` keeps fp32 master weights and the optimizer state in (pinned, where there is
  CUDA) CPU memory and steps them with torch's fused CPU implementation
  (``torch.optim.AdamW(fused=True)`` runs on the CPU): gradients are copied device-to-host on a
  side stream, the master weights stepped, and the updated values copied back. No optimizer
  state of an offloaded bucket exists on the device.

Every rank that holds a bucket steps it the same way (a CPU worker steps an offloaded bucket
with the same fused CPU optimizer as the stage), so all copies stay identical.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = [
    "BucketStep",
    "DeviceStep",
    "OffloadStep",
    "param_index",
    "with_offloaded_state",
    "load_with_offloaded_state",
    "offload_for_memory",
]


def param_index(optimizer: Optimizer) -> dict[nn.Parameter, tuple[int, int]]:
    """Each parameter of ``optimizer`` -> (its group, its index in ``state_dict()``'s numbering)."""
    index, position = {}, 0
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            index[p] = (g, position)
            position += 1
    return index


def _bucket_groups(optimizer: Optimizer, params: Sequence[Tensor], index: dict) -> tuple[list[dict], list[int]]:
    """Parameter groups for ``params`` (one per user group they come from), and which user group each mirrors."""
    by_group: dict[int, list[Tensor]] = {}
    for p in params:
        if p in index:
            by_group.setdefault(index[p][0], []).append(p)
    groups = [{**_hyperparameters(optimizer.param_groups[g]), "params": ps} for g, ps in sorted(by_group.items())]
    return groups, sorted(by_group)


# How an optimizer computes, rather than what: a bucket's step chooses these for itself.
_IMPLEMENTATION = ("params", "fused", "foreach", "capturable", "differentiable")


def _hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in _IMPLEMENTATION}


def _constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (AdamW's include a flag it sets itself)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


class BucketStep:
    """The optimizer step of one bucket. ``step()`` consumes the bucket's gradients."""

    params: list[nn.Parameter]

    def step(self) -> None:
        raise NotImplementedError

    def _sync_hyperparameters(self, optimizer: Optimizer, user: Optimizer, sources: list[int]) -> None:
        """Copy the user groups' current hyperparameters (an LR scheduler may have changed them)."""
        for group, source in zip(optimizer.param_groups, sources):
            group.update(_hyperparameters(user.param_groups[source]))


class DeviceStep(BucketStep):
    """The user's optimizer, stepping only this bucket's parameters, sharing the user optimizer's state."""

    def __init__(self, optimizer: Optimizer, params: Sequence[nn.Parameter], index: dict) -> None:
        self.user = optimizer
        self.params = [p for p in params if p in index]
        groups, self.sources = _bucket_groups(optimizer, self.params, index)
        self.optimizer = type(optimizer)(groups, **_constructor_defaults(optimizer)) if groups else None

    def step(self) -> None:
        if self.optimizer is not None:
            # One state, as if the user's optimizer stepped: taken anew each time, because
            # `load_state_dict` (resuming) replaces the user optimizer's state dict.
            self.optimizer.state = self.user.state
            self._sync_hyperparameters(self.optimizer, self.user, self.sources)
            self.optimizer.step()
        for p in self.params:
            p.grad = None


class OffloadStep(BucketStep):
    """fp32 master weights and optimizer state in CPU memory, stepped with a fused CPU optimizer.

    A parameter that already lives in CPU memory in the master's dtype (on a CPU worker, or an
    emulated stage) is its own master: it is stepped in place, with no second copy. Pass
    ``host_copies=True`` to keep separate masters anyway (to measure what the copies cost).
    """

    def __init__(
        self, optimizer: Optimizer, params: Sequence[nn.Parameter], index: dict, host_copies: bool | None = None
    ) -> None:
        self.user = optimizer
        self.params = [p for p in params if p in index]
        pin = torch.cuda.is_available() and any(p.device.type == "cuda" for p in self.params)
        self.masters = [self._master(p, pin, host_copies) for p in self.params]
        self.grads = [None if m is p else torch.empty_like(m, pin_memory=pin) for p, m in zip(self.params, self.masters)]
        groups, self.sources = _bucket_groups(optimizer, self.params, index)
        by_param = dict(zip(self.params, self.masters))
        for group in groups:
            group["params"] = [by_param[p] for p in group["params"]]
        self.optimizer = _cpu_optimizer(optimizer, groups) if groups else None
        self._stream = torch.cuda.Stream(self.params[0].device) if pin else None

    @staticmethod
    def _master(param: nn.Parameter, pin: bool, host_copies: bool | None) -> nn.Parameter:
        dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
        if not host_copies and param.device.type == "cpu" and param.dtype == dtype:
            return param
        master = torch.empty(param.shape, dtype=dtype, pin_memory=pin)
        master.copy_(param.detach())
        return nn.Parameter(master, requires_grad=param.requires_grad)

    def step(self) -> None:
        self._to_host()
        if self.optimizer is not None:
            self._sync_hyperparameters(self.optimizer, self.user, self.sources)
            self.optimizer.step()
        self._to_device()

    def _to_host(self) -> None:
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.params[0].device))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for p, master, grad in zip(self.params, self.masters, self.grads):
                if master is p:
                    continue
                if p.grad is None:
                    master.grad = None
                else:
                    grad.copy_(p.grad, non_blocking=True)
                    master.grad = grad
                p.grad = None
        if stream is not None:
            stream.synchronize()

    def _to_device(self) -> None:
        stream = self._stream
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else nullcontext():
            for p, master in zip(self.params, self.masters):
                if master is p:
                    p.grad = None
                else:
                    p.copy_(master, non_blocking=True)
        if stream is not None:
            # The next forward runs on the default stream; make it wait for the new weights.
            torch.cuda.current_stream(self.params[0].device).wait_stream(stream)

    def state(self) -> dict[nn.Parameter, dict[str, Any]]:
        """Optimizer state per (device) parameter, as the user's optimizer would hold it."""
        if self.optimizer is None:
            return {}
        return {p: self.optimizer.state[m] for p, m in zip(self.params, self.masters) if m in self.optimizer.state}

    def load_state(self, states: dict[nn.Parameter, dict[str, Any]]) -> None:
        """Take optimizer state (e.g. from a checkpoint) for this bucket's parameters."""
        for p, master in zip(self.params, self.masters):
            if p in states and self.optimizer is not None:
                self.optimizer.state[master] = {
                    k: v.to("cpu", dtype=master.dtype if v.is_floating_point() and k != "step" else v.dtype)
                    if isinstance(v, Tensor)
                    else v
                    for k, v in states[p].items()
                }
            if master is not p:
                master.data.copy_(p.detach())


def _cpu_optimizer(optimizer: Optimizer, groups: list[dict]) -> Optimizer:
    """The user's optimizer class over CPU tensors, with torch's fused CPU kernel where it has one."""
    defaults = _constructor_defaults(optimizer)
    for flag in ("fused", "foreach", "capturable"):
        defaults.pop(flag, None)
    if "fused" in inspect.signature(type(optimizer).__init__).parameters:
        defaults["fused"] = True
    return type(optimizer)(groups, **defaults)


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
    offloaded = {p: step for step in steps if isinstance(step, OffloadStep) for p in step.params}
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


def offload_for_memory(params: Sequence[Sequence[nn.Parameter]], device: torch.device, share: float = 0.25) -> list[int]:
    """Which of a GPU stage's buckets (given in backward order) to offload until a planner decides:
    the first ones the backward finishes (their CPU step has the most backward left to hide
    behind), until the optimizer state left on the device fits in ``share`` of its memory.
    Adam-like state is counted as two copies of the parameters."""
    if device.type != "cuda":
        return []
    budget = share * torch.cuda.get_device_properties(device).total_memory
    sizes = [2 * sum(p.numel() * p.element_size() for p in bucket) for bucket in params]
    left, chosen = sum(sizes), []
    for k, size in enumerate(sizes):
        if left <= budget:
            break
        chosen.append(k)
        left -= size
    return chosen
