"""A bucket's optimizer step, on the device or offloaded to CPU master weights, is the user's optimizer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hetero.offload import DeviceStep, OffloadStep, param_index
from lightning_hetero.sync import make_buckets


def params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=g, dtype=torch.float64)) for shape in ((5, 3), (3,))]


def grads(step: int, like: list[nn.Parameter]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in like]


@pytest.mark.parametrize("host_copies", [False, True])
@pytest.mark.parametrize("kind", ["adamw", "sgd", "tensor-lr"])
def test_offloaded_step_is_the_users_optimizer(host_copies: bool, kind: str) -> None:
    def make(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        if kind == "sgd":
            return torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)
        lr = torch.tensor(0.01) if kind == "tensor-lr" else 0.01  # torch's fused kernel applies a tensor in float32
        return torch.optim.AdamW([{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0.0}], lr=lr)

    reference, mine = params(), params()
    ref_opt, user = make(reference), make(mine)
    step = OffloadStep(user, mine, param_index(user), host_copies=host_copies)
    assert all((m is p) != host_copies for p, m in zip(mine, step.masters))
    for k in range(5):
        user.param_groups[0]["lr"] *= 0.9  # an LR schedule changes the user's groups
        ref_opt.param_groups[0]["lr"] *= 0.9
        for p, g in zip(reference, grads(k, reference)):
            p.grad = g
        ref_opt.step()
        for p, g in zip(mine, grads(k, mine)):
            p.grad = g.clone()
        step.step()
    for a, b in zip(reference, mine):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)
        assert b.grad is None
    assert not user.state  # the state lives with the offloaded step, not in the user's optimizer


def test_state_round_trip_keeps_separate_masters() -> None:
    ps = [nn.Parameter(torch.randn(4, 4).bfloat16())]
    user = torch.optim.AdamW(ps, lr=0.01)
    step = OffloadStep(user, ps, param_index(user))
    assert step.masters[0].dtype == torch.float32 and step.masters[0] is not ps[0]
    ps[0].grad = torch.randn(4, 4).bfloat16()
    step.step()
    state = step.state()
    assert torch.equal(state[ps[0]][OffloadStep.MASTER], step.masters[0])
    fresh = OffloadStep(user, ps, param_index(user))
    fresh.load_state(state)
    assert torch.equal(fresh.masters[0], step.masters[0])  # not the rounded bf16 weights
    assert torch.equal(fresh.optimizer.state[fresh.masters[0]]["exp_avg"], step.optimizer.state[step.masters[0]]["exp_avg"])


def test_a_master_the_weights_moved_on_from_is_not_loaded() -> None:
    """A checkpoint whose fp32 masters a run without them carried along (plain Lightning resumed
    from an offloaded run and trained on): the masters no longer round to the weights, and the
    weights are what was trained, so the bucket starts from them."""
    ps = [nn.Parameter(torch.randn(4, 4).bfloat16())]
    user = torch.optim.AdamW(ps, lr=0.01)
    step = OffloadStep(user, ps, param_index(user))
    ps[0].grad = torch.randn(4, 4).bfloat16()
    step.step()
    state = step.state()
    with torch.no_grad():
        ps[0].add_(0.5)  # trained on elsewhere
    fresh = OffloadStep(user, ps, param_index(user))
    fresh.load_state(state)
    assert torch.equal(fresh.masters[0], ps[0].detach().float())


def test_device_step_shares_the_users_state() -> None:
    ps = params()
    user = torch.optim.Adam(ps, lr=0.01)
    step = DeviceStep(user, ps[:1], param_index(user))
    ps[0].grad = torch.ones_like(ps[0])
    step.step()
    assert set(user.state) == {ps[0]} and ps[0].grad is None
    user.load_state_dict(user.state_dict())  # replaces the state dict, as resuming does
    ps[0].grad = torch.ones_like(ps[0])
    step.step()
    assert float(user.state[ps[0]]["step"]) == 2.0


def test_buckets_do_not_depend_on_precision() -> None:
    layers = [nn.Linear(64, 64) for _ in range(4)]
    bounds = [(0, 2), (2, 4)]
    fp32 = make_buckets(layers, bounds, bucket_bytes=64 * 65 * 4)
    half = make_buckets([layer.bfloat16() for layer in layers], bounds, bucket_bytes=64 * 65 * 4)
    assert fp32 == half and [b.layers for b in fp32] == [(3, 4), (2, 3), (1, 2), (0, 1)]
