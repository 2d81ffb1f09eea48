"""SIGTERM, SLURM's requeue signal and a step method's ``trainer.should_stop``, acted on by every
rank at the same step.

Lightning acts on a signal where it lands. Its SIGTERM handler broadcasts from rank 0 inside the
handler, and its training loop broadcasts a SIGTERM flag from rank 0 before every step. Its SLURM
auto-requeue handler (``SLURMEnvironment(auto_requeue=True)``, the default, on the signal that
``#SBATCH --signal=SIGUSR1@90`` sends) saves a checkpoint inside the handler, which here is a
collective: every rank contributes its stage's state. A signal reaches each process at its own
point of the step, so those collectives meet the step's own (a pipeline's sends, the exchange of
the step's reports) and the run fails.

Here a handler only notes its signal. The note travels in the step's report exchange, which every
rank takes part in anyway (``engine.py``), and every rank acts on what any rank noted, at the same
point: after a SIGTERM the step ends and every rank raises Lightning's ``SIGTERMException`` (for
``on_exception`` callbacks), as Lightning does after its broadcast; after the requeue signal, every
rank saves Lightning's HPC checkpoint (``hpc_ckpt_N.ckpt``, which ``fit(ckpt_path="hpc")`` resumes
from) at the start of the next training step, and rank 0 requeues the job with ``scontrol``. That
also saves Lightning's broadcast at every step, which made every step of every rank start when
global rank 0 (a CPU worker) got there, even where the CPU workers have no share of the batch.

A step method (``training_step``, ``validation_step``) that sets ``self.trainer.should_stop`` runs
only on the ranks that compute the step's outputs; its ``STOP`` travels the same way, so every rank
stops after the same step (a pipeline's first stage would otherwise train on, alone).

[Note: a signal that lands late]
SLURM signals every task once, but a rank can note it after the exchange in which another rank's
note was agreed on. A rank that had not noted a requeue signal when one was agreed on takes the
next one it gets as that same signal, so the job is checkpointed and requeued once. (Every rank
acts on SIGTERM once anyway: it ends the run.)

A process that gets a SIGTERM passes it on to the node's other ranks, so every process notes it,
whichever one it landed in: where the CPU workers have no share of a batch they do not report to
the stages ([Note: one-way exchange] in ``results.py``), and under popen a ``kill`` of the script
reaches global rank 0 alone. (The requeue signal is not passed on: SLURM signals every task.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Optional

from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.trainer.connectors.signal_connector import _SIGNUM, _SignalConnector
from lightning.pytorch.utilities.exceptions import SIGTERMException

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["StepSignals", "TERMINATE", "REQUEUE", "STOP", "pass_on"]

log = logging.getLogger(__name__)

TERMINATE = 1
REQUEUE = 2
STOP = 4
"""``trainer.should_stop``, where a step method set it: it runs only on the ranks that compute the
step's outputs (the CPU workers with a share, a pipeline's last stage), which must not stop alone."""


class StepSignals(_SignalConnector):
    """Lightning's signal connector, with the handlers only noting their signal (``pending``) and
    every rank acting on what ``agree`` hears from all (see the module's note). ``peers``: the
    process ids of the node's other ranks, to which a SIGTERM is passed on.

    The handlers only ever set their own flag, and ``agree`` clears only the flags it agreed on, so
    a signal that lands while a report is read is not lost (a handler runs between any two of the
    main thread's bytecodes)."""

    def __init__(self, trainer: "pl.Trainer", peers: Sequence[int] = ()) -> None:
        super().__init__(trainer)
        self.peers = list(peers)
        self._terminate = self._requeue_noted = self._requeue_expected = self._requeue = False

    @classmethod
    def install(cls, trainer: "pl.Trainer", peers: Sequence[int]) -> Optional[StepSignals]:
        """Take over the trainer's signal handling for a run of several processes (before the
        trainer registers its handlers); None for one process, where Lightning's acts alike."""
        if trainer.world_size < 2:
            return None
        signals = cls(trainer, peers)
        trainer._signal_connector = signals
        # The training loop's broadcast of rank 0's SIGTERM flag, at the start of every step.
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = signals.at_step_start  # type: ignore[method-assign]
        return signals

    @property
    def pending(self) -> int:
        """The signals this process noted that no exchange has agreed on yet (``TERMINATE | REQUEUE``)."""
        return (TERMINATE if self._terminate else 0) | (REQUEUE if self._requeue_noted else 0)

    def register_signal_handlers(self) -> None:
        super().register_signal_handlers()
        self._terminate = self._requeue_noted = self._requeue_expected = self._requeue = False

    def _sigterm_notifier_fn(self, signum: _SIGNUM, _: Optional[FrameType]) -> None:
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", self.trainer.local_rank))
        if self._terminate or self.received_sigterm:
            return
        self._terminate = True
        # Every process of the node notes it too, wherever it landed: a CPU worker without a share
        # of the batches does not report to the stages ([Note: one-way exchange] in `results.py`).
        pass_on(signum, self.peers)

    def _slurm_sigusr_handler_fn(self, signum: _SIGNUM, _: Optional[FrameType]) -> None:
        if self._requeue_expected:  # the signal already agreed on, landing late here
            self._requeue_expected = False
        else:
            self._requeue_noted = True

    def noted(self) -> int:
        """What this rank's report carries: the signals it noted, and ``STOP`` where its trainer is to stop."""
        return self.pending | (STOP if self.trainer.should_stop else 0)

    def agree(self, noted: int) -> None:
        """``noted``: what any rank's report carried in this exchange (the same on every rank)."""
        if not noted:
            return
        if noted & STOP:
            self.trainer.should_stop = True
        if noted & TERMINATE:
            self.received_sigterm, self._terminate = True, False
        if noted & REQUEUE:
            if not self._requeue_noted:
                self._requeue_expected = True
            self._requeue_noted, self._requeue = False, True

    def at_step_start(self) -> None:
        """In place of Lightning's per-step broadcast: save and requeue, or end, as agreed."""
        if self._requeue:
            self._requeue = False
            environment = self.trainer._accelerator_connector.cluster_environment
            signum = getattr(environment, "requeue_signal", None) or signal.SIGUSR1
            super()._slurm_sigusr_handler_fn(signum, None)  # type: ignore[arg-type]
        if self.received_sigterm:
            raise SIGTERMException()


def pass_on(signum: int, pids: Sequence[int]) -> None:
    """Send ``signum`` to each of ``pids`` that is still there."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
