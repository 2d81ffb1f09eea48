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
with the same fused CPU optimizer as the stage), so all copies stay identical; with two or more
CPU workers, they split an offloaded bucket's step between them instead (``sharding.py``).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Literal, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = [
    "BucketStep",
    "DeviceStep",
    "OffloadStep",
    "param_index",
    "check_offload",
    "choose_offloaded",
    "offload_for_memory",
]

OffloadArg = Union[Literal["auto", "none", "all"], Sequence[int]]


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


def _step_without_closure(optimizer: Optimizer) -> None:
    """Step a bucket: during the backward, where there is no loss to evaluate again."""
    try:
        optimizer.step()
    except TypeError as error:
        if "'NoneType' object is not callable" not in str(error):
            raise
        raise TypeError(
            f"`{type(optimizer).__name__}.step` calls its closure (it evaluates the loss again), which fine mode"
            " cannot give it: each bucket steps during the backward. Use `mode='coarse'`."
        ) from error


def _of_the_users_kind(optimizer: Optimizer, groups: list[dict], defaults: dict[str, Any]) -> Optimizer:
    """The user's optimizer class over ``groups``, built by its constructor from ``defaults``; where
    the constructor needs arguments its defaults do not hold (a subclass's own, such as a scale), a
    copy of the user's optimizer, which keeps those in its attributes, over ``groups`` instead."""
    accepted = list(inspect.signature(type(optimizer).__init__).parameters.values())[2:]  # self, params
    required = {p.name for p in accepted if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if required <= defaults.keys():
        return type(optimizer)(groups, **defaults)
    clone = copy.copy(optimizer)
    Optimizer.__init__(clone, groups, {**optimizer.defaults, **defaults})
    return clone


class BucketStep:
    """The optimizer step of one bucket. ``step()`` consumes the bucket's gradients."""

    params: list[nn.Parameter]

    def gradient_destination(self, param: nn.Parameter) -> Tensor:
        """The tensor whose ``.grad`` should receive ``param``'s summed gradient."""
        return param

    def grad_holders(self) -> list[Tensor]:
        """The tensors whose ``.grad`` this step consumes (for clipping)."""
        return list(self.params)

    def step(self) -> None:
        raise NotImplementedError

    def lacks_state(self) -> bool:
        """Whether a trainable parameter of this bucket has no optimizer state yet (its first step
        makes it)."""
        return False

    def skip(self) -> None:
        """Drop the bucket's gradients without stepping (a step skipped on every rank)."""
        for tensor in [*self.params, *self.grad_holders()]:
            tensor.grad = None

    def after_all_steps(self) -> None:
        """Called on the training thread once every bucket has stepped."""

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
        self.optimizer = _of_the_users_kind(optimizer, groups, _constructor_defaults(optimizer)) if groups else None

    def lacks_state(self) -> bool:
        return self.optimizer is not None and any(p.requires_grad and p not in self.user.state for p in self.params)

    def step(self) -> None:
        if self.optimizer is not None:
            # One state, as if the user's optimizer stepped: taken anew each time, because
            # `load_state_dict` (resuming) replaces the user optimizer's state dict.
            self.optimizer.state = self.user.state
            self._sync_hyperparameters(self.optimizer, self.user, self.sources)
            _step_without_closure(self.optimizer)
        for p in self.params:
            p.grad = None


class OffloadStep(BucketStep):
    """fp32 master weights and optimizer state in CPU memory, stepped with a fused CPU optimizer.

    A parameter that already lives in CPU memory in the master's dtype (on a CPU worker, or an
    emulated stage) is its own master: it is stepped in place, with no second copy. Pass
    ``host_copies=True`` to keep separate masters anyway (to measure what the copies cost).
    Summed gradients go straight into the masters (``gradient_destination``); a gradient still
    on the device (no CPU worker to sum with) is copied over on a side stream.
    """

    MASTER = "hetero_master"
    """The key under which a separate master weight travels in a checkpoint's optimizer state."""

    def __init__(
        self, optimizer: Optimizer, params: Sequence[nn.Parameter], index: dict, host_copies: bool = False
    ) -> None:
        self.user = optimizer
        self.params = [p for p in params if p in index]
        pin = torch.cuda.is_available() and any(p.device.type == "cuda" for p in self.params)
        self.masters = [self._master(p, pin, host_copies) for p in self.params]
        self._master_of = dict(zip(self.params, self.masters))
        self.grads = [None if m is p else torch.empty_like(m, pin_memory=pin) for p, m in zip(self.params, self.masters)]
        groups, self.sources = _bucket_groups(optimizer, self.params, index)
        for group in groups:
            group["params"] = [self._master_of[p] for p in group["params"]]
        self.optimizer = _cpu_optimizer(optimizer, groups) if groups else None
        self._stream = torch.cuda.Stream(self.params[0].device) if pin else None
        self._uploaded: Any = None
        self._versions = self._weight_versions()

    @staticmethod
    def _master(param: nn.Parameter, pin: bool, host_copies: bool) -> nn.Parameter:
        dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
        if not host_copies and param.device.type == "cpu" and param.dtype == dtype:
            return param
        master = torch.empty(param.shape, dtype=dtype, pin_memory=pin)
        master.copy_(param.detach())
        return nn.Parameter(master, requires_grad=param.requires_grad)

    def gradient_destination(self, param: nn.Parameter) -> Tensor:
        return self._master_of.get(param, param)

    def grad_holders(self) -> list[Tensor]:
        # A gradient summed with none (no CPU worker's share) is still the weight's until `_to_host`
        # moves it: it is clipped there, before the step.
        return [m if m is p or p.grad is None else p for p, m in zip(self.params, self.masters)]

    def lacks_state(self) -> bool:
        state = self.optimizer.state if self.optimizer is not None else None
        return state is not None and any(p.requires_grad and m not in state for p, m in zip(self.params, self.masters))

    def step(self) -> None:
        self._take_edited_weights()
        self._to_host()
        if self.optimizer is not None:
            self._sync_hyperparameters(self.optimizer, self.user, self.sources)
            with _unfused_where_momentum_is_partial(self.optimizer):
                _step_without_closure(self.optimizer)
        self._to_device()

    def after_all_steps(self) -> None:
        # The next forward runs on the compute stream: it waits for the new weights, while the
        # backward that ran alongside the steps did not.
        if self._uploaded is not None:
            torch.cuda.current_stream(self.params[0].device).wait_event(self._uploaded)
            self._uploaded = None

    def _weight_versions(self) -> list[int]:
        return [p._version for p in self.params]

    def _take_edited_weights(self) -> None:
        """A weight changed in place since its master was last copied to it (a constraint or a reset in
        a hook, values loaded into it): its master takes the new value, as one process steps from it."""
        with torch.no_grad():
            for p, master, version in zip(self.params, self.masters, self._versions):
                if master is not p and p._version != version:
                    master.copy_(p.detach())

    def _to_host(self) -> None:
        """Copy gradients still on the device into the masters' (the summed ones are there already)."""
        moving = [(p, m, g) for p, m, g in zip(self.params, self.masters, self.grads) if m is not p and p.grad is not None]
        if not moving:
            return
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.params[0].device))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for p, master, grad in moving:
                grad.copy_(p.grad, non_blocking=True)
                master.grad = grad
        if stream is not None:
            stream.synchronize()  # before the device gradients are released to the allocator
        for p, _, _ in moving:
            p.grad = None

    def _to_device(self) -> None:
        stream = self._stream
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else nullcontext():
            for p, master in zip(self.params, self.masters):
                if master is p:
                    p.grad = None
                else:
                    p.copy_(master, non_blocking=True)
                    master.grad = None
        if stream is not None:
            self._uploaded = stream.record_event()
        self._versions = self._weight_versions()

    def state(self) -> dict[nn.Parameter, dict[str, Any]]:
        """Optimizer state per (device) parameter, as the user's optimizer would hold it; a separate
        master weight (e.g. fp32 under bf16 weights) travels with it, so no precision is lost."""
        if self.optimizer is None:
            return {}
        states = {}
        for p, master in zip(self.params, self.masters):
            if master in self.optimizer.state:
                states[p] = dict(self.optimizer.state[master])
            # An optimizer that keeps no state (SGD without momentum) has stepped a master all the same:
            # one that no longer equals its weight carries what the weight's rounding lost.
            if master is not p and (p in states or not master.equal(p.detach().to(master.device, master.dtype))):
                states.setdefault(p, {})[self.MASTER] = master.detach().clone()
        return states

    def load_state(self, states: dict[nn.Parameter, dict[str, Any]]) -> None:
        """Take optimizer state (e.g. from a checkpoint) for this bucket's parameters."""
        for p, master in zip(self.params, self.masters):
            state = dict(states.get(p, {}))
            saved_master = state.pop(self.MASTER, None)
            if master is not p:
                # A master that no longer rounds to the weight is stale: a run that kept no masters
                # (plain Lightning, or nothing offloaded) trained on from the checkpoint that had it.
                current = saved_master is not None and saved_master.to(p.device, p.dtype).equal(p.detach())
                master.data.copy_(saved_master if current else p.detach())
            if state and self.optimizer is not None:
                self.optimizer.state[master] = {
                    k: v.to("cpu", dtype=master.dtype if v.is_floating_point() and k != "step" else v.dtype)
                    if isinstance(v, Tensor)
                    else v
                    for k, v in state.items()
                }
        self._versions = self._weight_versions()  # the weights as loaded, each with its master


@contextmanager
def _unfused_where_momentum_is_partial(optimizer: Optimizer) -> Iterator[None]:
    """torch's fused SGD steps a group as its first step (no momentum buffer yet) or with a buffer for
    every parameter, and fails where parameters trained since (unfrozen) have none beside others that
    do: such a group steps unfused, as the user's optimizer steps every parameter, until all have one."""
    partial = []
    if isinstance(optimizer, torch.optim.SGD):
        for group in optimizer.param_groups:
            if group.get("fused") and group["momentum"]:
                fresh = [optimizer.state.get(p, {}).get("momentum_buffer") is None for p in group["params"] if p.grad is not None]
                if any(fresh) and not all(fresh):
                    partial.append(group)
                    group["fused"] = False
    try:
        yield
    finally:
        for group in partial:
            group["fused"] = True


def _cpu_optimizer(optimizer: Optimizer, groups: list[dict]) -> Optimizer:
    """The user's optimizer class over CPU tensors, with torch's fused CPU kernel where it has one
    and steps as the user's optimizer does: not where a hyperparameter is a tensor (a learning rate
    ``torch.tensor(0.01)``), which the fused kernel applies in another precision."""
    defaults = _constructor_defaults(optimizer)
    for flag in ("fused", "foreach", "capturable"):
        defaults.pop(flag, None)
    tensors = any(isinstance(v, Tensor) for group in optimizer.param_groups for k, v in group.items() if k != "params")
    if "fused" in inspect.signature(type(optimizer).__init__).parameters and not tensors:
        defaults["fused"] = True
    return _of_the_users_kind(optimizer, groups, defaults)


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


def bucket_indices(offload: Any) -> bool:
    """Whether ``offload`` is a collection of bucket indices (integers >= 0), as a list of them must be."""
    return isinstance(offload, (Sequence, set, frozenset)) and all(
        isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in offload
    )


def check_offload(offload: Any, mode: str) -> None:
    """Raise a clear error for an ``offload`` argument no run could follow."""
    if isinstance(offload, str):
        if offload not in ("auto", "none", "all"):
            raise ValueError(f"`offload={offload!r}` must be 'auto', 'none', 'all' or a list of bucket indices.")
        if offload == "all" and mode != "fine":
            raise ValueError("`offload='all'` offloads fine mode's bucket steps; it needs `mode='fine'`.")
        return
    if not bucket_indices(offload):
        raise ValueError(f"`offload={offload!r}` must be 'auto', 'none', 'all' or a list of bucket indices (integers >= 0).")
    if offload and mode != "fine":
        raise ValueError("`offload=[...]` offloads fine mode's bucket steps; it needs `mode='fine'`.")


def choose_offloaded(
    offload: OffloadArg,
    buckets: Sequence[Any],
    own: Sequence[Any],
    params: Sequence[Sequence[nn.Parameter]],
    device: torch.device,
    group: dist.ProcessGroup,
) -> set[int]:
    """The indices of the offloaded buckets, the same on every rank. For ``"auto"``, each GPU stage
    decides for its own buckets (``own``) from its device's memory (``offload_for_memory``), and
    every rank learns the union (a collective)."""
    if offload == "none":
        return set()
    if offload == "all":
        return {b.index for b in buckets}
    if not isinstance(offload, str):
        return set(offload)
    chosen = offload_for_memory([params[b.index] for b in own], device) if own else []
    mine = [own[k].index for k in chosen]
    decisions: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(decisions, mine, group=group)
    return {k for decision in decisions for k in decision}
