"""A hetero run's checkpoints are ordinary Lightning checkpoints.

Every rank takes part in writing one: a CPU worker that kept out of the latest optimizer steps is
brought up to date first (``state.refresh_replicas``); where global rank 0 holds the whole model
(a CPU worker, or a replica) it saves as in one process; where it holds only stage 0's slice,
the stages' slices and their optimizer state (offloaded buckets' included) are gathered to it
into the state dicts a single-process model has (``state.py``). Loading gives each rank its part.
The file is written whole or not at all (``files.AtomicCheckpointIO``).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.trainer.states import TrainerStatus
from torch.optim import Optimizer

from lightning_hetero.files import AtomicCheckpointIO
from lightning_hetero.sharding import gather_sharded_state
from lightning_hetero.state import gather_module_state, gather_optimizer_state
from lightning_hetero.state import load_with_offloaded_state, with_offloaded_state

if TYPE_CHECKING:
    from lightning_hetero.engine import StepEngine

__all__ = ["StageCheckpoints"]


class StageCheckpoints:
    """Mixin for the hetero strategy: Lightning's checkpoint hooks. The strategy provides
    ``_engine`` (its step engine once set up), ``whole_model_on_rank_zero``, ``bucket_steps``,
    ``control_group``, ``local_mesh``, ``refresh_replicas`` and ``every_rank`` (``collectives.py``),
    ``stopped_after_a_failure``, ``describe_rank``, ``rank_name`` and ``on_exception``."""

    _engine: Optional[StepEngine]
    _checkpoint_io: Optional[CheckpointIO]

    @property
    def checkpoint_io(self) -> CheckpointIO:
        # Lightning's default, except that a process killed while saving leaves the previous
        # checkpoint intact (`files.py`); a CheckpointIO passed in is used as it is.
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO):
            self._checkpoint_io.checkpoint_io = AtomicCheckpointIO()  # only where it wraps none
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._checkpoint_io = io

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.stopped_after_a_failure() and self.global_rank != 0:
            # Global rank 0 stops the other ranks after a failure, so this rank's save would wait for it
            # until the timeout: it ends now, its failure recorded for rank 0 to name (where Lightning has
            # not yet: a save in an `on_exception` callback comes before the strategy's hook).
            failure = sys.exc_info()[1]
            if failure is not None and self.describe_rank() not in getattr(failure, "__notes__", []):
                self.on_exception(failure)
            raise RuntimeError(
                f"[hetero] {self.rank_name(self.local_rank)} failed, and a checkpoint is written after it: under"
                " popen global rank 0 writes it alone, where it holds the whole model (docs/reliability.md), and"
                " stops the other ranks; this one ends here."
            )
        with self.every_rank("Writing a checkpoint"):
            mesh = self.local_mesh
            if mesh is not None and self.lightning_module.trainer.state.status == TrainerStatus.RUNNING:
                # Every rank answers first: one that is still training (a save under `if trainer.is_global_zero:`)
                # waits for the step's reports there, and both sides are told at once that they are out of step.
                # Not after a failure (`on_exception`), where a rank holding the whole model writes it alone.
                mesh.all_gather_object(None)
            self.refresh_replicas()  # every rank calls this when a checkpoint is written
            if self.whole_model_on_rank_zero:
                return super().lightning_module_state_dict()  # type: ignore[misc]
            return gather_module_state(self.lightning_module, self.control_group)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        with self.every_rank("Writing a checkpoint"):
            return self._optimizer_state(optimizer)

    def _optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        state = with_offloaded_state(optimizer, self.bucket_steps)
        if self._engine is not None and self._engine.worker.sharding is not None:
            # The CPU workers' optimizer split between them: each one's part to rank 0 (`sharding.py`).
            mine = self._engine.state_sync.sharded_state(optimizer)
            state = gather_sharded_state(optimizer, mine, state, self.control_group)
        return state if self.whole_model_on_rank_zero else gather_optimizer_state(state, self.control_group)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Lightning loads a checkpoint before `setup`. A stage placed by an earlier call of this process
        # (popen, torchrun) holds the other stages' blocks on the meta device: torch copies nothing into
        # them (a no-op it warns of), and checks the keys against the whole model, as for one process.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter in the checkpoint to a meta")
            super().load_model_state_dict(checkpoint, strict=strict)  # type: ignore[misc]

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            load_with_offloaded_state(optimizer, state, self.bucket_steps)
            _optimizers_to_device([optimizer], self.root_device)
