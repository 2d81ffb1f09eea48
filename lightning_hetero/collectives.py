"""Lightning's collectives for a run whose ranks sit on different devices.

Every rank of a hetero run joins one gloo group over all of them, the *control* group
(``topology.ProcessGroups.control``): a CPU worker and a GPU stage can both talk on it, where an
NCCL group would leave the CPU out. ``ControlCollectives`` gives a strategy Lightning's
``reduce``, ``all_gather``, ``barrier`` and ``broadcast`` over it (tensors travel through a CPU
copy and come back on their device), and ``gather`` for any picklable object. Where every rank
runs on this host, objects (``broadcast``, ``gather``) travel over Unix sockets between the ranks
instead (``local_mesh``, ``mesh.py``), which a busy core does not hold up as it does gloo's thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Optional, Union

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available, _distributed_is_initialized, _sync_ddp
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerStatus
from torch import Tensor

from lightning_hetero.mesh import LocalMesh, note_not_answered
from lightning_hetero.topology import READY_DIR_ENV, gather_object_to

__all__ = ["ControlCollectives", "IN_STEP_METHOD", "not_in_a_step_method"]

IN_STEP_METHOD: ContextVar[bool] = ContextVar("hetero_in_step_method", default=False)
"""True while a worker runs a step method on its share of a batch (set by ``results.LogCapture``)."""


def not_in_a_step_method(call: str) -> RuntimeError:
    """The error for a collective (``call``) in a step method, which not every process runs."""
    return RuntimeError(
        f"{call} in a step method: under the hetero strategy a step method runs on one worker's share of"
        " the batch, and not in every process (a pipeline's stages before the last never run it, and a CPU worker"
        " only while it has a share), so a collective there would wait for processes that never reach it. What"
        " `self.log(...)` and torchmetrics metrics record in step methods is combined over the workers, as for the"
        " whole batch in one process; run other collectives in a hook that every process runs (`on_train_batch_start`,"
        " an epoch-end hook)."
    )


def _every_process(call: str) -> None:
    if IN_STEP_METHOD.get():
        raise not_in_a_step_method(call)


class ControlCollectives:
    """Mixin for a Lightning strategy: its collectives over ``self.control_group`` (``None``: the
    default group)."""

    @property
    def control_group(self) -> Optional[dist.ProcessGroup]:
        raise NotImplementedError

    @property
    def local_mesh(self) -> Optional[LocalMesh]:
        """Unix sockets between every rank, where all run on this host (the control group's ranks)."""
        return None

    def ranks_gone(self) -> Optional[str]:
        """Between trainer calls: which ranks of the run this process can tell have ended (``None``:
        none, or it cannot tell)."""
        return None

    @contextmanager
    def every_rank(self, what: str) -> Iterator[None]:
        """Collectives that every rank must reach, as with DDP: where one fails because a rank has
        left the script, the error says which and why."""
        try:
            yield
        except (RuntimeError, ConnectionError, TimeoutError) as error:  # gloo: "Connection closed by peer"
            gone = self.ranks_gone()
            if gone:
                error.add_note(
                    f"[hetero] {what} needs every rank, but since the last trainer call {gone}. Every rank runs"
                    " the script's trainer calls and `trainer.save_checkpoint`, as with DDP: call them on every"
                    " rank, not under `if trainer.is_global_zero:`."
                )
            else:
                note_not_answered(error, f"{what} needs every rank, and not every rank came to it")
            raise

    def gather(self, obj: Any, dst: Optional[int] = None) -> list[Any]:
        """Every rank's ``obj`` (picklable), indexed by global rank, over the control group (a
        collective). With ``dst``, only that global rank receives them; the others get ``[]``."""
        _every_process("`trainer.strategy.gather`")
        group, mesh = self.control_group, self.local_mesh
        if mesh is not None:
            with self.every_rank("Gathering"):
                return (mesh.gather_object(obj, dst) or []) if dst is not None else mesh.all_gather_object(obj)
        if dst is not None:
            with self.every_rank("Gathering"):
                return gather_object_to(obj, dst, group) or []
        objects: list[Any] = [None] * dist.get_world_size(group)
        with self.every_rank("Gathering"):
            dist.all_gather_object(objects, obj, group=group)
        return objects

    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Union[Tensor, Any]:
        _every_process("`trainer.strategy.reduce`")
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        with self.every_rank("Reducing"):
            return _sync_ddp(tensor.cpu(), group=group or self.control_group, reduce_op=reduce_op).to(tensor.device)

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        _every_process("`trainer.strategy.all_gather`")
        with self.every_rank("Gathering"):
            gathered = _all_gather_ddp_if_available(tensor.cpu(), group=group or self.control_group, sync_grads=sync_grads)
        return gathered.to(tensor.device)

    def stopped_after_a_failure(self) -> bool:
        """Whether this popen run is in its ``on_exception`` hooks after an error (not the orderly stop
        after a SIGTERM, which every rank makes): global rank 0 stops the other ranks then, so no
        collective can reach them all (the ranks of a torchrun or SLURM launch are not stopped)."""
        trainer = getattr(getattr(self, "lightning_module", None), "_trainer", None)
        if trainer is None or trainer.state.status != TrainerStatus.INTERRUPTED or not os.environ.get(READY_DIR_ENV):
            return False
        return not getattr(trainer._signal_connector, "received_sigterm", False)

    def barrier(self, name: Optional[str] = None) -> None:
        _every_process("`trainer.strategy.barrier`")
        if self.stopped_after_a_failure():
            return  # the other ranks are stopped: rank 0 goes on alone (`OnExceptionCheckpoint`'s save)
        if _distributed_is_initialized():
            with self.every_rank(f"The barrier {name!r}" if name else "A barrier"):
                dist.barrier(group=self.control_group)

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        _every_process("`trainer.strategy.broadcast`")
        if not _distributed_is_initialized():
            return obj
        mesh = self.local_mesh
        if mesh is not None:
            with self.every_rank("Broadcasting"):
                return mesh.broadcast_object(obj, src)
        box = [obj]
        with self.every_rank("Broadcasting"):
            dist.broadcast_object_list(box, src, group=self.control_group)
        return box[0]
