"""``MixRebalancer``: a multimodal model's encoders re-placed as the mix of modalities changes.

[Note: following the mix]
Which encoder belongs where depends on how many samples carry its modality: an image-heavy phase
of a dataset wants the image encoder on the device that encodes images fastest, a text-heavy one
may free that device for the backbone and send the texts elsewhere. Every rank sees every batch,
so every rank knows the mix: the fraction of the batch's samples that carry each modality
(``modality_inputs``), smoothed over batches (``smoothing``: the weight of the newest). Every
``every_n_steps`` optimizer steps, global rank 0 predicts the step of every placement at the
smoothed mix and the run's shares (``encoder_planner``, from the encoders' profile: the workload
analyzer's, or one this callback takes at the start) and decides; every rank applies its word
from the next batch:

- *try*: a placement predicted at least ``min_gain`` faster than the current one is tried for a
  window, the current window's measured step kept as its baseline;
- *keep* / *undo*: after the try, the placement stays if its measured step beat the baseline, and
  the previous one comes back if not (that placement is then not tried again for 3, 6, 12, ...
  decisions): a move is kept only where it measured faster than where it came from. Where the mix
  moved during the try, the baseline is scaled as the cost model says the previous placement's step
  moved from the mix of the baseline's batches to that of the try's;
- *hold*: nothing to gain.

The steps right after a change (``warmup_steps``) are not measured. Every decision is logged under
``mix/*`` (each modality's smoothed share, the predicted and measured step, the reason as an index
into ``REASONS``), kept in ``decisions``, and saved with checkpoints.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_hetero.encoder_planner import EncoderProfile, best_placement, predict_placement, samples_by_place
from lightning_hetero.multimodal import carrying
from lightning_hetero.shares import batch_size_of
from lightning_hetero.strategy import hetero_strategy

if TYPE_CHECKING:
    from lightning_hetero.strategy import HeteroStrategy

__all__ = ["MixRebalancer", "MixFollower", "REASONS"]

REASONS = ("start", "hold", "try", "keep", "undo", "resume")


@dataclass
class MixFollower:
    """The decisions of ``MixRebalancer`` (see the module's note), from what every decision is given."""

    profile: EncoderProfile
    placement: dict[str, str]
    smoothing: float = 0.5
    min_gain: float = 0.05
    mix: dict[str, float] = field(default_factory=dict)
    """Each modality's share of the samples, smoothed."""
    trying: Optional[dict[str, Any]] = None
    """The placement under trial: the one before it and the baseline step it must beat."""
    refused: dict[str, int] = field(default_factory=dict)
    """Placements that measured slower, by key: the decision before which they are not tried again."""
    failures: dict[str, int] = field(default_factory=dict)
    decisions: int = 0

    window: dict[str, float] = field(default_factory=dict)
    """Each modality's share of the samples of the batches since the last decision, summed."""
    batches: int = 0

    def observe(self, carrying: dict[str, float]) -> None:
        """A batch's share of samples carrying each modality."""
        for modality in self.profile.costs().modalities:
            seen = carrying.get(modality, 0.0)
            last = self.mix.get(modality)
            self.mix[modality] = seen if last is None else self.smoothing * seen + (1 - self.smoothing) * last
            self.window[modality] = self.window.get(modality, 0.0) + seen
        self.batches += 1

    def _window_mix(self) -> dict[str, float]:
        """The mix of the batches since the last decision (that of the step times it is given)."""
        mix = {m: total / self.batches for m, total in self.window.items()} if self.batches else dict(self.mix)
        self.window, self.batches = {}, 0
        return mix

    def decide(self, step_s: float, samples: dict[str, float]) -> tuple[str, Optional[float]]:
        """The reason of this decision and the step predicted for the placement it leaves; ``placement``
        is the one to run from the next batch."""
        self.decisions += 1
        costs, measured = self.profile.costs(), self._window_mix()
        if self.trying is not None:
            trying, self.trying = self.trying, None
            # The baseline was measured at the mix of its window: as it would be at this one's.
            before = predict_placement(costs, samples, trying["mix"], trying["previous"]).step_s
            now = predict_placement(costs, samples, measured, trying["previous"]).step_s
            if step_s < trying["baseline_s"] * (now / before if before > 0 else 1.0):
                return "keep", predict_placement(costs, samples, self.mix, self.placement).step_s
            key = _key(self.placement)
            self.failures[key] = self.failures.get(key, 0) + 1
            self.refused[key] = self.decisions + 3 * 2 ** min(self.failures[key] - 1, 3)
            self.placement = trying["previous"]
            return "undo", predict_placement(costs, samples, self.mix, self.placement).step_s
        current = predict_placement(costs, samples, self.mix, self.placement)
        best = best_placement(costs, samples, self.mix, split_only=self.profile.split_only)
        refused = self.refused.get(_key(best.placement), 0) > self.decisions
        if best.placement != self.placement and best.step_s < current.step_s * (1 - self.min_gain) and not refused:
            self.trying = {"previous": dict(self.placement), "baseline_s": step_s, "mix": measured}
            self.placement = dict(best.placement)
            return "try", best.step_s
        return "hold", current.step_s

    def state_dict(self) -> dict[str, Any]:
        """The decision state (not the profile or the settings)."""
        fields = ("placement", "mix", "trying", "refused", "failures", "decisions", "window", "batches")
        return {name: copy.deepcopy(getattr(self, name)) for name in fields}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def _key(placement: dict[str, str]) -> str:
    return ",".join(f"{m}:{w}" for m, w in sorted(placement.items())) or "split"


class MixRebalancer(L.Callback):
    """Re-place a multimodal model's encoders as the mix of modalities in the data changes (see the
    module's note), never keeping a move that measured slower than where it came from.

    Args:
        every_n_steps: optimizer steps per decision.
        warmup_steps: steps after a change of placement left out of the measurement.
        smoothing: the weight of each batch's mix in the smoothed one (1: the latest batch alone).
        min_gain: try a placement only where it is predicted at least this much (relative) faster.
        repeats: timings per measurement where this callback profiles the encoders itself (without
            ``WorkloadAnalyzer``).
        verbose: print every decision that changes the placement.
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        warmup_steps: int = 1,
        smoothing: float = 0.5,
        min_gain: float = 0.05,
        repeats: int = 3,
        verbose: bool = True,
    ) -> None:
        if every_n_steps < 1 or not 0 <= warmup_steps < every_n_steps or not 0 < smoothing <= 1 or not 0 <= min_gain < 1:
            raise ValueError(
                "MixRebalancer needs `every_n_steps` >= 1, `warmup_steps` in [0, every_n_steps), `smoothing` in (0, 1]"
                " and `min_gain` in [0, 1)."
            )
        self.every_n_steps, self.warmup_steps = every_n_steps, warmup_steps
        self.smoothing, self.min_gain, self.repeats, self.verbose = smoothing, min_gain, repeats, verbose
        self.follower: Optional[MixFollower] = None
        self.decisions: list[dict[str, Any]] = []
        self._restored: Optional[dict[str, Any]] = None
        self._steps: list[float] = []
        self._since = 0
        self._skip = 0
        self._last_step = -1

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = hetero_strategy(trainer)
        engine = strategy.engine if strategy is not None else None
        whole = strategy is not None and (strategy.topology.replicas or strategy.topology.num_stages == 1)
        if engine is None or engine.worker.encoders is None or not whole:
            rank_zero_warn(
                "MixRebalancer does nothing here: it places the encoders of a multimodal model (`modality_encoders()`)"
                " between the processes of `strategy='hetero'` that hold the whole model (replicas, or one stage;"
                " in a pipeline of several stages, place them with `encoders=`)."
            )
            self.follower = None
            return
        profile = _analyzer_profile(trainer)
        if profile is None:
            from lightning_hetero.callbacks.analyzer import profile_encoders  # the analyzer imports the planner

            profile = profile_encoders(trainer, strategy, self.repeats)
        self.follower = MixFollower(profile, strategy.encoder_placement, self.smoothing, self.min_gain)
        reason = "start"
        if self._restored is not None:
            restored = self._restored["follower"]
            unfit = _cannot_place(strategy, pl_module, restored["placement"])
            if unfit is None:
                self.follower.load_state_dict(restored)
                self.decisions = list(self._restored["decisions"])
                reason = "resume"
            else:
                rank_zero_warn(
                    f"MixRebalancer: the checkpoint's placement {restored['placement']} cannot run on this layout"
                    f" ({unfit}); it starts again from this run's placement."
                )
            self._restored = None
        self._steps, self._skip, self._last_step = [], self.warmup_steps, trainer.global_step
        self._apply(trainer, strategy, strategy.broadcast(self.follower.state_dict(), src=0), reason, None, None)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.follower is not None:
            self.follower.observe(carrying(pl_module, batch))
            self._batch_size = batch_size_of(batch)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        strategy = hetero_strategy(trainer)
        if self.follower is None or strategy is None or trainer.global_step == self._last_step:
            return  # not a multimodal run, or accumulating: decide after optimizer steps only
        self._last_step = trainer.global_step
        self._since += 1
        if self._skip:
            self._skip -= 1
        elif strategy.step_records:
            self._steps.append(strategy.step_records[-1].total)
        if self._since < self.every_n_steps or not self._steps:
            return
        step_s = statistics.median(self._steps)
        outcome: Any = None
        if trainer.is_global_zero:
            topology = strategy.topology
            samples = samples_by_place(self._batch_size, strategy.cpu_fraction, topology.cpu_workers, topology.num_stages)
            reason, predicted = self.follower.decide(step_s, samples)
            outcome = (self.follower.state_dict(), reason, predicted)
        state, reason, predicted = strategy.broadcast(outcome, src=0)
        self._apply(trainer, strategy, state, reason, predicted, step_s)

    def _apply(
        self,
        trainer: L.Trainer,
        strategy: "HeteroStrategy",
        state: dict[str, Any],
        reason: str,
        predicted: Optional[float],
        step_s: Optional[float],
    ) -> None:
        """Every rank: take rank 0's decision state, and its placement from the next batch."""
        assert self.follower is not None
        self.follower.load_state_dict(state)
        self._steps, self._since = [], 0
        if self.follower.placement != strategy.encoder_placement:
            strategy.set_encoder_placement(self.follower.placement)
            self._skip = self.warmup_steps
            if self.verbose and reason != "resume":
                placed = ", ".join(f"{m} on {w}" for m, w in self.follower.placement.items()) or "every encoder split"
                rank_zero_info(f"MixRebalancer ({reason}, step {trainer.global_step}): {placed}")
        entry = {"step": trainer.global_step, "reason": reason, "placement": dict(self.follower.placement)}
        metrics = {"mix/reason": float(REASONS.index(reason)), "mix/placed": float(len(self.follower.placement))}
        metrics.update({f"mix/{m}": share for m, share in self.follower.mix.items()})
        for key, value in (("predicted_step_s", predicted), ("step_s", step_s)):
            if value is not None:
                metrics[f"mix/{key}"] = entry[key] = value
        entry["mix"] = dict(self.follower.mix)
        self.decisions.append(entry)
        del self.decisions[:-1000]
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.follower is None:
            return {}
        return {"follower": self.follower.state_dict(), "decisions": list(self.decisions)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict) if state_dict else None


def _analyzer_profile(trainer: L.Trainer) -> Optional[EncoderProfile]:
    """The workload analyzer's profile of the encoders, where it placed them in this fit."""
    from lightning_hetero.callbacks.analyzer import WorkloadAnalyzer

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, WorkloadAnalyzer) and callback.placement is not None:
            return callback.placement[0]
    return None


def _cannot_place(strategy: "HeteroStrategy", module: Any, placement: dict[str, str]) -> Optional[str]:
    """Why ``placement`` (a checkpoint's) cannot run on this run's layout, or ``None`` where it can."""
    try:
        strategy.placed_plan(placement, module)
    except ValueError as error:
        return str(error)
    return None
