"""``WorkloadAnalyzer``: measure the workload at fit start, plan the run, and check the plan.

In its ``setup`` hook, before the strategy cuts the model into stages, every process profiles
every layer on its own device (a stage's GPU, an emulated stage's CPU process, the CPU worker with
its threads) with the real first batch, and the links it uses; global rank 0 plans from those
measurements and every rank applies the same plan (``HeteroStrategy.apply_plan``). The plan and its predicted step time are logged (hyperparameters,
wandb config), written next to the logs with the profile, and explained as a table; once
training runs, the measured step time is logged beside the prediction.
"""

from __future__ import annotations

import inspect
import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_hetero import mesh
from lightning_hetero.data import training_loader
from lightning_hetero.encoder_planner import EncoderProfile, PlacementPrediction, best_placement, explain_placement, samples_by_place
from lightning_hetero.loading import CoreSplit, LoaderTimes, compute_between_loads, measure_loader, peek_batches, split_cores
from lightning_hetero.loading import tunable
from lightning_hetero.module import check_model_contract, layer_names, offers_blocks, pipeline_pair
from lightning_hetero.multimodal import carrying, encoder_stages, modality_encoders, offers_modalities, unplaceable_encoders
from lightning_hetero.plan import HeteroPlan
from lightning_hetero.planner import (
    Machine,
    Prediction,
    calibrated_optimizer_rates,
    explain,
    compare_layouts,
    predict_plan,
    step_method_rate,
)
from lightning_hetero.profiling import (
    DeviceTimes,
    LinkProfile,
    Profile,
    TiedProfile,
    all_reduce_over,
    send_along,
    gradient_sum_over,
    kept_buffers,
    optimizer_state_factor,
    profile_layers,
    step_work,
    tied_layers,
    time_encoders,
    time_link,
    time_optimizer,
    time_pipeline_action,
    time_window,
)
from lightning_hetero.record import StepRecord
from lightning_hetero.results import ReportExchange, WorkerReport
from lightning_hetero.shares import batch_size_of
from lightning_hetero.strategy import hetero_strategy
from lightning_hetero.numa import numa_nodes, usable_cpus
from lightning_hetero.topology import Role, gather_object_to, threads_for, usable_cores

if TYPE_CHECKING:
    from lightning_hetero.strategy import HeteroStrategy

__all__ = ["WorkloadAnalyzer", "profile_encoders"]

KEPT_FROM_THE_RUN = ("encoders", "cpu_cores", "shard_cpu_optimizer", "shard_across_nodes")
"""Plan fields the layout planner leaves as the run has them."""

log = logging.getLogger(__name__)

def fixed_cost(step: Sequence[tuple[float, float, float]]) -> float:
    """One step's fixed cost from every rank's ``(data, wait, optimizer)`` seconds of it (see
    ``WorkloadAnalyzer._calibrate``)."""
    return max(d + o for d, _, o in step) - max(o for _, _, o in step) + min(w for _, w, _ in step)


class WorkloadAnalyzer(L.Callback):
    """Profile every layer on every device at fit start, plan the layout, apply it, and explain it.

    Args:
        repeats: timings per measurement, after one warm-up; the median is kept.
        max_micro_batches: the most micro-batches the planner considers.
        warmup_steps: training steps before the measured ones. All but the first (which pays
            one-time costs) measure what the profile cannot: the fixed cost per step, the step
            method's own work, and how long the optimizer steps of processes on the CPU take in
            the run (see ``_calibrate`` for where they are timed). Each step's fixed
            cost varies by milliseconds with the operating system's scheduling, so more steps give
            a steadier prediction for a model whose step is short.
        measure_steps: training steps after the warm-up whose median step time is logged beside
            the predicted one; only steps at the plan's CPU fraction count (the rebalancer, where
            it runs too, tries others at times).
        memory_fraction: the share of each GPU's memory the planner may fill.
        contention_s: seconds the processes that compute on the CPU's cores (CPU workers, emulated
            stages) run a training step's compute together, and each alone, to measure how much of
            the cores they get when they share them (at least four steps' worth).
        save_dir: where ``plan.yaml``, ``profile.json`` and ``explain.txt`` go (default: the
            trainer's log directory).
    """

    def __init__(
        self,
        repeats: int = 3,
        max_micro_batches: int = 8,
        warmup_steps: int = 10,
        measure_steps: int = 20,
        memory_fraction: float = 0.9,
        contention_s: float = 0.3,
        save_dir: Optional[str] = None,
    ) -> None:
        if warmup_steps < 2 or measure_steps < 1:
            raise ValueError(
                f"WorkloadAnalyzer needs `warmup_steps` >= 2 and `measure_steps` >= 1 (got `warmup_steps={warmup_steps}`,"
                f" `measure_steps={measure_steps}`): the first step pays one-time costs, and the warm-up measures"
                " the steps after it."
            )
        self.repeats = repeats
        self.warmup_steps = warmup_steps
        self.contention_s = contention_s
        self.max_micro_batches = max_micro_batches
        self.measure_steps = measure_steps
        self.memory_fraction = memory_fraction
        self.save_dir = save_dir
        self.plan: Optional[HeteroPlan] = None
        self.prediction: Optional[Prediction] = None
        self._pipelines = True
        """Whether the model could train as a pipeline (a run of replicas weighs one beside it only then)."""
        self.alternative: Optional[tuple[HeteroPlan, Prediction]] = None
        """The best layout of the other parallelism (replicas beside a pipeline, or the reverse) for
        the same run, and its prediction, where one fits."""
        self.profile: Optional[Profile] = None
        self.loading: Optional[tuple[LoaderTimes, CoreSplit]] = None
        """The training DataLoader's time per batch by worker processes, and the split of the cores
        between loading and compute chosen from it (``loading.py``)."""
        self.measured_step_s: Optional[float] = None
        self.placement: Optional[tuple[EncoderProfile, dict[str, float], PlacementPrediction]] = None
        """A multimodal model's encoder costs, each place's samples of a batch, and the placement chosen."""
        self._workers_next_epoch: Optional[int] = None
        self._calibrated = False
        self._steps: list[float] = []
        self._planned = False

    # ------------------------------------------------------------ planning

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Have a fit's layout planned by ``plan_layout`` when the strategy is about to cut the model
        (after the module's own ``setup`` and ``configure_model``, in the run's precision)."""
        strategy = hetero_strategy(trainer)
        if strategy is None or stage != TrainerFn.FITTING:
            return
        self._planned = False
        blocks = strategy.plan.parallelism != "replicas" or offers_blocks(pl_module)
        encoders = offers_modalities(pl_module) and (strategy.plan.parallelism == "replicas" or len(strategy.plan.stages) == 1)
        if not blocks and not encoders:
            rank_zero_warn(
                "WorkloadAnalyzer profiles a model block by block (`pipeline_layers()`), and this one offers none: it"
                " trains as its layout sets (with `cpu_fraction='auto'` the rebalancer finds the CPU's share)."
            )
            self._planned = True  # nothing to plan
            return
        strategy.plan_with(partial(self._plan_run, blocks=blocks, encoders=encoders))

    def _plan_run(
        self, trainer: L.Trainer, strategy: "HeteroStrategy", layers: list[nn.Module], blocks: bool, encoders: bool
    ) -> HeteroPlan:
        """The layout of a model that offers blocks (``plan_layout``), then the place of a multimodal
        model's encoders (``place_encoders``), on every rank (collective)."""
        self.placement = None
        if blocks:
            # What the planner does not choose stays as the run has it: the encoders' places (next),
            # the CPU workers' cores and their split optimizer.
            kept = {name: getattr(strategy.plan, name) for name in KEPT_FROM_THE_RUN}
            plan = replace(self.plan_layout(trainer, strategy, layers, places_encoders=encoders), **kept)
        else:
            self.prediction = self.profile = self.measured_step_s = None
            self._planned, plan = True, strategy.plan
        self.plan = self.place_encoders(trainer, strategy, plan) if encoders else plan
        return self.plan

    def place_encoders(self, trainer: L.Trainer, strategy: "HeteroStrategy", plan: HeteroPlan) -> HeteroPlan:
        """Time a multimodal model's encoders and the rest of its step on every rank, one at a time, and
        the link between two ranks; place the encoders where the step is shortest (rank 0,
        ``encoder_planner.best_placement``) at the plan's CPU fraction; ``plan`` with that placement on
        every rank (collective)."""
        profile = profile_encoders(trainer, strategy, self.repeats)
        topology = strategy.topology
        samples = samples_by_place(profile.batch_size, plan.cpu_fraction, topology.cpu_workers, topology.num_stages)
        best = best_placement(profile.costs(), samples, profile.carrying, split_only=profile.split_only)
        self.placement = (profile, samples, best)
        return replace(plan, encoders=self.placement[2].placement)

    def plan_layout(
        self, trainer: L.Trainer, strategy: "HeteroStrategy", layers: list[nn.Module], places_encoders: bool = False
    ) -> HeteroPlan:
        """Profile on every rank, plan on rank 0, and return the plan on every rank (collective).
        ``places_encoders``: the encoders are placed after the cut (``place_encoders``), so a
        zero-bubble schedule's first stage keeps every encoder's block, wherever it goes."""
        log.debug("WorkloadAnalyzer: profiling %d blocks on %s", len(layers), strategy.rank_name(strategy.local_rank))
        self.prediction = self.profile = self.measured_step_s = None
        self._calibrated, self._steps, self._planned = False, [], True
        module = trainer.lightning_module
        self._pipelines = True
        if strategy.plan.parallelism == "replicas":
            # Replicas hold parameter blocks; the model's own blocks are profiled (a pipeline's rules aside:
            # BatchNorm, a `backward` of its own leave no pipeline to weigh beside).
            try:
                layers = check_model_contract(module)
            except (TypeError, ValueError):
                self._pipelines = False
                layers = check_model_contract(module, pipeline=False)
        batch = strategy.precision_plugin.convert_input(next(iter(training_loader(trainer))))
        batch_size = batch_size_of(batch)
        mine = self._measure(strategy, module, layers, *pipeline_pair(module, batch), batch_size)
        assert strategy.process_groups is not None
        control = strategy.process_groups.control
        parts = gather_object_to(mine, 0, control)
        result: list[Any] = [None]
        if strategy.global_rank == 0:
            assert parts is not None
            placed = dict.fromkeys(modality_encoders(module), "") if places_encoders else strategy.plan.encoders
            encoder_layers = _encoder_layers(module, placed, layers)
            tied = tied_layers(layers)
            result = [(*self._plan(trainer, strategy, parts, batch_size, encoder_layers, tied), self.alternative, self.loading)]
        dist.broadcast_object_list(result, src=0, group=control)
        self.plan, self.prediction, self.profile, self.alternative, self.loading = result[0]
        return self.plan

    def _measure(
        self,
        strategy: "HeteroStrategy",
        module: nn.Module,
        layers: list[nn.Module],
        inputs: Any,
        targets: Any,
        batch_size: int,
    ) -> dict[str, Any]:
        """This rank's share of the profile: its device's layer times, and the links it is on."""
        device, role = strategy.root_device, strategy.role
        # BatchNorm (replicas) cannot normalize a lone sample by its own statistics in training.
        fewest = min(batch_size, 2 if any(isinstance(m, _BatchNorm) for layer in layers for m in layer.modules()) else 1)
        sizes = (max(fewest, batch_size // self.max_micro_batches), batch_size)
        optimizer = _init_optimizers_and_lr_schedulers(module)[0]
        optimizer = optimizer[0] if optimizer else None
        shapes = [p.shape for layer in layers for p in layer.parameters() if p.requires_grad]
        control = strategy.process_groups.control  # type: ignore[union-attr]
        sharing = self._sharing(strategy)
        # One rank at a time: processes that share the CPU's cores (CPU workers, emulated stages,
        # every GPU stage's host thread) would otherwise measure each other.
        for turn in range(dist.get_world_size(control)):
            if turn == strategy.global_rank:
                names = layer_names(module, layers)
                trainer = strategy.lightning_module.trainer
                title = f"Profiling {role} ({device})" if trainer.progress_bar_callback is not None else None
                loss = (module.pipeline_loss, targets)
                forward, backward, described, (loss_forward, loss_backward) = profile_layers(
                    layers, names, inputs, device, sizes, self.repeats, title, loss
                )
                step = self._step_work(module, layers, inputs, targets) if sharing else None
                alone = {
                    layout: self._with_threads(n, lambda: time_window(step, self.contention_s)) if step else None
                    for layout, n in sharing.items()
                }
                times = DeviceTimes(
                    device=_describe(device),
                    threads=torch.get_num_threads(),
                    forward=forward,
                    backward=backward,
                    optimizer_s_per_param=_optimizer_rate(optimizer, shapes, device, fused_cpu=False),
                    offloaded_s_per_param=_optimizer_rate(optimizer, shapes, torch.device("cpu"), fused_cpu=True),
                    loss_forward=loss_forward,
                    loss_backward=loss_backward,
                    step_s_by_threads={sharing[layout]: seconds for layout, seconds in alone.items() if seconds},
                )
            dist.barrier(group=control)
        together = self._together(control, step, sharing, alone)
        gradient_bytes = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers)
        links = self._measure_links(strategy, sum(layer.param_bytes for layer in described), gradient_bytes)
        if "pipeline" in links:
            # All stage processes at once, over their group: what each action of a schedule costs on the
            # path it waits on, its send's latency included; the link keeps the bandwidth a send's bytes take.
            times.action_s = time_pipeline_action(device, strategy.process_groups.stage, 2 * self.repeats + 1)  # type: ignore[union-attr]
            links["pipeline"] = replace(links["pipeline"], latency=0.0)
        exchange_s = self._exchange_time(strategy)
        memory = None
        if device.type == "cuda":
            memory = self.memory_fraction * torch.cuda.get_device_properties(device).total_memory
        return {
            "role": profile_role(role),
            "times": times,
            "layers": described,
            "links": links,
            "memory": memory,
            "state_factor": optimizer_state_factor(optimizer),
            "exchange_s": exchange_s,
            "node": strategy.node_rank,
            "affinity": sorted(usable_cpus()),
            "sharing": {layout: (sharing[layout], alone[layout], together[layout]) for layout in sharing},
        }

    @staticmethod
    def _sharing(strategy: "HeteroStrategy") -> dict[str, int]:
        """The layouts in which this rank computes on the CPU's cores, with its threads in each
        (``threads_for``), where measuring them tells the planner something: ``"shared"``, where
        the CPU workers have a share of the batch (every CPU worker and emulated stage computes),
        if the node has more than one such process to share the cores; and ``"stages"``, where
        they have none (the emulated stages compute alone, with the CPU workers' cores)."""
        if strategy.root_device.type != "cpu":
            return {}
        role, topology, cores = strategy.role, strategy.topology, usable_cores()
        on_cpu = topology.cpu_workers + sum(d.type == "cpu" for d in topology.stage_devices)
        layouts = {}
        if on_cpu > 1:
            layouts["shared"] = threads_for(role, topology, cores, strategy.plan.cpu_threads, cpu_share=True)
        if not role.is_cpu_worker:
            layouts["stages"] = threads_for(role, topology, cores, strategy.plan.cpu_threads, cpu_share=False)
        return layouts

    def _step_work(self, module: nn.Module, layers: list[nn.Module], inputs: Any, targets: Any) -> Optional[Any]:
        """The whole model's training compute on the batch (see ``step_work``), leaving no trace:
        the batch, as an emulated stage computes it where it gains threads (a layout without a CPU
        share), since how much threads help depends on the size of the work. None, with a
        warning, where it cannot run this way (the cores then count as they are)."""
        work = step_work(layers, module.pipeline_loss, inputs, targets)

        def traceless() -> None:
            with torch.random.fork_rng(devices=[]), kept_buffers(layers):
                work()

        try:
            traceless()
        except Exception as error:  # a measurement's detail: never worth failing the fit for
            rank_zero_warn(f"WorkloadAnalyzer could not run a training step's compute on its own ({error!r}).")
            return None
        return traceless

    @staticmethod
    def _with_threads(threads: int, measure: Any) -> float:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return measure()
        finally:
            torch.set_num_threads(before)

    def _together(
        self, control: dist.ProcessGroup, step: Optional[Any], sharing: dict[str, int], alone: dict[str, Optional[float]]
    ) -> dict[str, Optional[float]]:
        """Seconds per step of the compute when the ranks of each layout (``_sharing``) run it at
        once, in a window as long as four of the slowest rank's steps alone (collective)."""
        longest = torch.tensor([max((a for a in alone.values() if a), default=0.0)], dtype=torch.float64)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=control)
        window = max(self.contention_s, 4 * float(longest))
        together = {}
        for layout in ("shared", "stages"):
            start = lambda: dist.barrier(group=control)  # noqa: E731
            if layout in sharing and step is not None:
                together[layout] = self._with_threads(sharing[layout], lambda: time_window(step, window, start))
            else:
                together[layout] = None
                start()
            dist.barrier(group=control)
        return together

    def _exchange_time(self, strategy: "HeteroStrategy", repeats: int = 10) -> float:
        """Seconds to share a step's results (loss and a few logged values) between the ranks, all
        ranks at once as in the run (median of ``repeats`` after two warm-ups)."""
        report = WorkerReport(samples=1, loss=0.0, loss_dtype=torch.float32, logs=[])
        groups = strategy.process_groups
        assert groups is not None
        share = ReportExchange(groups.control, mesh=groups.mesh)
        times = []
        for _ in range(repeats + 2):
            start = time.perf_counter()
            share(report)
            times.append(time.perf_counter() - start)
        return statistics.median(times[2:])

    def _measure_links(self, strategy: "HeteroStrategy", model_bytes: int, layer_bytes: int) -> dict[str, LinkProfile]:
        """Every rank takes part in the measurements of the groups it is in, in the same order.
        Transfers are timed at a small size and at about the size they carry in the run (the
        model's gradients for the sum, a layer's for host copies), where their bandwidth is."""
        groups = strategy.process_groups
        assert groups is not None
        links: dict[str, LinkProfile] = {}
        cpu = torch.device("cpu")
        small = 1 << 14
        if groups.mesh is not None:  # both sizes where the run's sums go: shared memory, from `SHARED_FROM` bytes on
            small = max(small, mesh.SHARED_FROM // 4)
        sizes = (small, max(4 * small, min(1 << 24, model_bytes // 4 // max(1, len(groups.sync)))))
        for group in groups.sync:
            if group is not None:
                link = time_link(gradient_sum_over(group, groups.mesh), cpu, sizes, repeats=self.repeats)
                if not strategy.role.is_cpu_worker:
                    links["sync"] = link
        if groups.stage is not None and strategy.role.is_stage and len(strategy.topology.stage_devices) > 1:
            device = strategy.root_device
            links["pipeline"] = time_link(send_along(groups.stage), device, repeats=self.repeats)
        if strategy.root_device.type == "cuda" and not strategy.role.is_cpu_worker:
            numel = max(1 << 16, min(1 << 24, layer_bytes // 4))
            pinned = torch.empty(numel, pin_memory=True)
            copy = lambda b: pinned[: b.numel()].copy_(b)  # noqa: E731
            links["d2h"] = time_link(copy, strategy.root_device, (1 << 14, numel), repeats=self.repeats)
        return links

    def _plan(
        self,
        trainer: L.Trainer,
        strategy: "HeteroStrategy",
        parts: list[dict[str, Any]],
        batch_size: int,
        encoder_layers: int,
        tied: list[TiedProfile],
    ) -> tuple[HeteroPlan, Prediction, Profile]:
        """Rank 0: assemble the profile, plan, and split the cores between loading and compute. The
        schedule and stages per process are the arguments', or where they leave them to the planner
        (``"auto"``) its choice among GPipe, 1F1B and the multi-stage schedules this torch has; the
        first ``encoder_layers`` layers stay in the first stage of a zero-bubble schedule
        (``plan_run``)."""
        devices: dict[str, DeviceTimes] = {}
        links: dict[str, LinkProfile] = {}
        memory: dict[str, float] = {}
        for part in parts:
            devices.setdefault(part["role"], part["times"])
            for name, link in part["links"].items():
                links.setdefault(name, link)
            if part["memory"] is not None:
                memory[part["role"]] = part["memory"]
        # The machine as its node's processes see it: a CPU worker pinned to one NUMA node (rank 0, here)
        # sees only that node's cores.
        affinity = {core for part in parts if part["node"] == strategy.node_rank for core in part["affinity"]}
        cores = len(affinity)
        profile = Profile(
            batch_size=batch_size,
            layers=parts[0]["layers"],
            devices=devices,
            links=links,
            optimizer_state_factor=parts[0]["state_factor"],
            cpu_cores=cores,
            device_memory=memory,
            step_overhead_s=max(part["exchange_s"] for part in parts),
            shared_cores=_shared_cores(parts, cores),
            numa_nodes=[list(node.cpus) for node in numa_nodes(affinity=affinity)],
            tied=tied,
        )
        schedule, stages_per_process = strategy.schedule_request
        layouts = compare_layouts(
            profile,
            _machine(strategy, profile),
            batch_size,
            mode=strategy.mode,
            schedule=schedule,
            max_micro_batches=self.max_micro_batches,
            bucket_size_mb=strategy.plan.bucket_size_mb,
            stages_per_process=stages_per_process,
            encoder_layers=encoder_layers,
            # The run's processes and groups exist already, for its parallelism: the analyzer plans
            # that, and weighs the other's best layout beside it (`explanation`, `plan_<other>.yaml`).
            require=strategy.plan.parallelism,
        )
        plan, prediction = layouts.pop(strategy.plan.parallelism)
        self.alternative = next(iter(layouts.values()), None) if self._pipelines else None
        self.loading = self._measure_loading(trainer, strategy, plan, prediction, cores)
        if self.loading is not None:
            split = self.loading[1]
            plan.predicted_step_s = split.step_s
            prediction = replace(prediction, step_s=split.step_s, data_s=split.step_s - prediction.step_s)
        return plan, prediction, profile

    @staticmethod
    def _measure_loading(
        trainer: L.Trainer, strategy: "HeteroStrategy", plan: HeteroPlan, prediction: Prediction, cores: int
    ) -> Optional[tuple[LoaderTimes, CoreSplit]]:
        """Measure the training DataLoader by worker processes (every count where
        ``dataloader_workers`` lets the run choose them; otherwise its own) and predict the step with
        the workers it has. The split itself waits for the warm-up (``_check_split``): the profile
        cannot tell the step's whole compute, and a split from it could take cores the run needs."""
        loader, topology = training_loader(trainer), strategy.topology
        if not isinstance(loader, DataLoader):
            return None
        policy = strategy.dataloader_workers
        current = policy if isinstance(policy, int) else loader.num_workers
        only = None if tunable(loader, policy) else current
        times = measure_loader(loader, cores, enough_s=0.02 * prediction.step_s, only=only)
        if times is None:
            return None
        loaders = topology.procs_per_node  # every rank of a node loads every batch
        split = split_cores(
            times, prediction.step_s, cores, loaders, topology.cpu_workers, cpu_threads=plan.cpu_threads,
            fixed_workers=current, **_stages(topology, cores),
        )  # fmt: skip
        return times, split

    # -------------------------------------------------------------- hooks

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if hetero_strategy(trainer) is not None and not self._planned:
            # The strategy laid the model out before this fit (an earlier `validate` in this process).
            rank_zero_warn("WorkloadAnalyzer: the model was laid out before this fit, in this process; no plan.")
            self.plan = self.prediction = self.profile = None
            return
        if self.placement is not None:
            self._explain_placement(trainer)
        if self.plan is None or self.prediction is None or self.profile is None:
            return
        for logger in trainer.loggers:
            logger.log_hyperparams({"hetero_plan": self.plan.as_dict(), "hetero_predicted_step_s": self.prediction.step_s})
        directory = self._directory(trainer)  # every rank: `trainer.log_dir` is a collective
        needed = self.warmup_steps + self.measure_steps
        if 0 <= trainer.max_steps < needed:
            rank_zero_warn(
                f"WorkloadAnalyzer measures the step time after {self.warmup_steps} warm-up steps and"
                f" {self.measure_steps} more, {needed} in all; with `max_steps={trainer.max_steps}` only the"
                " prediction is logged. Lower `warmup_steps` or `measure_steps` to see both."
            )
        if trainer.is_global_zero:
            self.plan.save(directory / "plan.yaml")
            self.profile.save(directory / "profile.json")
            table = self.explanation()
            (directory / "explain.txt").write_text(table + "\n")
            rank_zero_info(f"WorkloadAnalyzer plan (also in {directory}):\n{self.plan.table()}\n\n{table}")
            if self.alternative is not None:
                other, predicted = self.alternative
                path = other.save(directory / f"plan_{other.parallelism}.yaml")
                if predicted.step_s < 0.9 * self.prediction.step_s:
                    rank_zero_info(
                        f"WorkloadAnalyzer: parallelism={other.parallelism!r} is predicted"
                        f" {self.prediction.step_s / predicted.step_s:.2f}x as fast as this layout; to train that way,"
                        f" pass `plan='{path}'` (or `parallelism={other.parallelism!r}`)."
                    )

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.prediction is None or self.measured_step_s is not None:
            return
        strategy = trainer.strategy
        record = strategy.step_records[-1] if strategy.step_records else None
        if record is None or trainer.global_step < self.warmup_steps:  # the warm-up's optimizer steps
            return
        if not self._calibrated:
            self._calibrate(trainer)  # every rank, at the same batch: a collective
            return
        if record.step < self.warmup_steps or not self._in_plan(record):
            return
        self._steps.append(record.total)
        if len(self._steps) < self.measure_steps:
            return
        self.measured_step_s = statistics.median(self._steps)
        metrics = {
            "analyzer/predicted_step_s": self.prediction.step_s,
            "analyzer/measured_step_s": self.measured_step_s,
            "analyzer/prediction_error": self.measured_step_s / self.prediction.step_s - 1,
            "analyzer/fixed_step_s": self.prediction.overhead_s,
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        directory = self._directory(trainer)
        if trainer.is_global_zero:
            table = self.explanation()
            (directory / "explain.txt").write_text(table + "\n")
            rank_zero_info(f"WorkloadAnalyzer, predicted vs measured:\n{table}")

    def _in_plan(self, record: StepRecord) -> bool:
        """Whether the step ran at the plan's CPU fraction (to the sample): the rebalancer, where
        it runs too, measures other fractions at times, which the prediction is not for."""
        assert self.plan is not None and self.profile is not None
        return abs(record.cpu_fraction - self.plan.cpu_fraction) * self.profile.batch_size < 0.5

    def _calibrate(self, trainer: L.Trainer) -> None:
        """Measure in the warm-up steps what the profile cannot see, put it in the profile (in place
        of the estimates made before training), and predict the plan's layout again with it: the
        fixed cost per step, the step method's own work, and the optimizer steps' time.

        The profile cannot see the training loop's own work (Lightning's hooks and logging, the
        batch load) as it is done between busy processes, so it is taken from the steps after the
        first (which pays one-time costs): per step, the longest time a rank spent between steps,
        plus the shortest time a rank spent sharing the results (the last to arrive waits for no
        one; the others' extra is the slower side's work, which the model predicts). A rank that
        steps less waits between steps for the others' optimizer steps (the next step starts with a
        collective), which the model predicts too: so the time between steps is counted with each
        rank's optimizer step, less the longest one. The step method's own work (metrics, logging)
        is the last stage's replay of it, less the loss's forward (``step_method_rate``). The
        optimizer steps of the processes on the CPU are timed in the run
        (``calibrated_optimizer_rates``): their speed depends on the process's memory allocator
        and threads in ways a step on its own does not reproduce. That is done in coarse mode,
        where they follow the sum, without clipping by norm (whose all-reduce waits for the other
        ranks inside the step), on the first node, and where the warm-up ran at one CPU fraction
        (the rebalancer may try others): it is played out at that fraction. Batches that
        accumulate gradients have no step and are left out. All of these change every layout
        alike or nearly so, so the plan it chose stays the best one."""
        assert self.prediction is not None and self.profile is not None and self.plan is not None
        self._calibrated = True
        strategy = trainer.strategy
        records = [r for r in strategy.step_records if 1 <= r.step < self.warmup_steps]
        mine = [(r.data, r.wait, r.optimizer, r.total) for r in records]
        # The last stage's replay of the step method: what the profile cannot time beyond the loss.
        # (The process of the last stage: the last stage process, or in a V the first.)
        holds_last = strategy.role.is_stage and strategy.plan.stage_holders()[-1] == strategy.role.index
        replays = [(_replayed(r), r.samples) for r in records if holds_last and r.samples]
        role = profile_role(strategy.role)
        clip_waits = bool(trainer.gradient_clip_val) and trainer.gradient_clip_algorithm != "value"
        # A step queued on a GPU is not timed by the host's clock; fine mode's steps overlap the backward.
        timed = strategy.root_device.type == "cpu" and self.plan.mode == "coarse" and not clip_waits
        steps = [r.optimizer for r in records if r.optimizer > 0] if timed and strategy.node_rank == 0 else []
        fractions = {r.cpu_fraction for r in records}
        ranks = strategy.gather((mine, replays, (role, steps), fractions))
        per_step = [fixed_cost([r[:3] for r in step]) for step in zip(*(fixed for fixed, _, _, _ in ranks))]
        if not per_step:
            return
        self._check_split(trainer, [list(step) for step in zip(*(fixed for fixed, _, _, _ in ranks))])
        self.profile.step_overhead_s = statistics.median(per_step)
        machine = _machine(strategy, self.profile)
        ran = set().union(*(fractions for _, _, _, fractions in ranks))
        warm = replace(self.plan, cpu_fraction=ran.pop()) if len(ran) == 1 else None  # the layout the warm-up ran
        replayed = [replay for _, replays, _, _ in ranks for replay in replays]
        if replayed:
            seconds, samples = statistics.median(s for s, _ in replayed), statistics.median(n for _, n in replayed)
            self.profile.step_method_s_per_sample = step_method_rate(self.profile, machine, warm or self.plan, seconds, samples)
        by_role: dict[str, list[float]] = {}
        for _, _, (name, times), _ in ranks:
            by_role.setdefault(name, []).extend(times)
        measured = {name: statistics.median(times) for name, times in by_role.items() if times}
        if warm is not None and measured:
            for name, rate in calibrated_optimizer_rates(self.profile, machine, warm, measured).items():
                self.profile.devices[name].optimizer_s_per_param = rate
        weighed = self.prediction.considered  # as planned, from the profile alone
        self.prediction = replace(predict_plan(self.profile, machine, self.plan), considered=weighed)
        if self.alternative is not None:  # weighed beside the plan with the same measurements (explain.txt)
            other = self.alternative[0]
            self.alternative = (other, predict_plan(self.profile, machine, other))
        directory = self._directory(trainer)
        if trainer.is_global_zero:
            self.profile.save(directory / "profile.json")

    def _check_split(self, trainer: L.Trainer, steps: list[list[tuple[float, float, float, float]]]) -> None:
        """Split the cores between loading and compute, from the warm-up (every rank alike, from every
        rank's records): the step's compute without its wait for data
        (``loading.compute_between_loads``: Lightning's loop, your step method and the processes' own
        work included, which the profile cannot tell) and the DataLoader's measured times per worker
        count give the split (``loading.split_cores``). Where it differs from the run's, it applies:
        threads at once, loader workers from the next epoch; the plan and ``plan.yaml`` say so."""
        strategy = hetero_strategy(trainer)
        if self.loading is None or strategy is None or not strategy.tuned_loaders:
            return
        times, split = self.loading
        workers = strategy.tuned_loaders[0].num_workers
        timed = [[(total, data) for data, _, _, total in step] for step in steps]
        compute = compute_between_loads(timed, times, workers)
        topology, cores = strategy.topology, usable_cores()
        checked = split_cores(
            times, compute, cores, topology.procs_per_node, topology.cpu_workers, cpu_threads=split.given_threads,
            **_stages(topology, cores),
        )  # fmt: skip
        self.loading = (times, replace(checked, source="measured in the warm-up"))
        assert self.plan is not None
        plan = self.plan
        plan.dataloader_workers, plan.cpu_threads, plan.stage_threads = checked.dataloader_workers, checked.cpu_threads, checked.stage_threads
        if (checked.dataloader_workers, checked.cpu_threads, checked.stage_threads) == (workers, split.given_threads, None):
            return
        strategy.set_cpu_threads(checked.cpu_threads)
        strategy.set_stage_threads(checked.stage_threads)
        self._workers_next_epoch = checked.dataloader_workers
        directory = self._directory(trainer)  # on every rank: `trainer.log_dir` is a collective
        if trainer.is_global_zero:
            self.plan.save(directory / "plan.yaml")
            if self.prediction is not None:  # the split chosen, as plan.yaml has it, before any step is measured
                (directory / "explain.txt").write_text(self.explanation() + "\n")
        rank_zero_info(
            f"WorkloadAnalyzer: the cores, split for the warm-up's step ({compute * 1e3:.1f} ms of compute):"
            f" {checked.dataloader_workers} DataLoader worker(s) per rank from the next epoch; threads per CPU worker"
            f" {checked.cpu_threads or 'as the topology shares the cores'}, per emulated stage"
            f" {checked.stage_threads or 'as the topology shares the cores'} (explain.txt)."
        )

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = hetero_strategy(trainer)
        if strategy is not None and self._workers_next_epoch is not None:
            strategy.set_dataloader_workers(self._workers_next_epoch)
        self._workers_next_epoch = None

    def explanation(self) -> str:
        """Per layer: its time on each device and where it was placed; the predicted step time, and
        the measured one once training has run; a multimodal model's encoders and their placement."""
        assert self.profile is not None and self.plan is not None and self.prediction is not None
        text = explain(self.profile, self.plan, self.prediction, self.measured_step_s, self.alternative, self.loading)
        if self.placement is not None:
            text += "\n\n" + explain_placement(*self.placement[:2])
        return text

    def _explain_placement(self, trainer: L.Trainer) -> None:
        """Write ``encoders.json`` (the encoders' profile, for ``hetero-plan``), and where the model offers
        no blocks, ``plan.yaml`` and ``explain.txt`` with the placement alone."""
        assert self.placement is not None and self.plan is not None
        directory = self._directory(trainer)  # every rank: a collective
        if not trainer.is_global_zero:
            return
        profile, samples, chosen = self.placement
        profile.save(directory / "encoders.json")
        if self.prediction is None:
            self.plan.save(directory / "plan.yaml")
            table = explain_placement(profile, samples)
            (directory / "explain.txt").write_text(table + "\n")
            placed = ", ".join(f"{m} on {w}" for m, w in chosen.placement.items()) or "every encoder split"
            rank_zero_info(f"WorkloadAnalyzer placed the encoders: {placed} (also in {directory}):\n{table}")

    def _directory(self, trainer: L.Trainer) -> Path:
        """Where the plan goes; a collective (``trainer.log_dir``): call it on every rank."""
        directory = Path(self.save_dir or trainer.log_dir or trainer.default_root_dir)
        if trainer.is_global_zero:
            directory.mkdir(parents=True, exist_ok=True)
        return directory


def _encoder_layers(module: nn.Module, placement: Mapping[str, str], layers: Sequence[nn.Module]) -> int:
    """How many of the first layers hold the encoders placed on another process (0: none placed):
    the blocks a zero-bubble schedule keeps in its first stage (``planner.plan_run``)."""
    if not placement:
        return 0
    each = encoder_stages(module, placement, layers, [(i, i + 1) for i in range(len(layers))], strict=False)
    return max(each.values()) + 1 if each else 0


def profile_encoders(trainer: L.Trainer, strategy: "HeteroStrategy", repeats: int, mix_batches: int = 8) -> EncoderProfile:
    """A multimodal model's encoders and the rest of its step timed on every rank, one at a time
    (``profiling.time_encoders``), on the first of the first ``mix_batches`` training batches that
    carries the most modalities (a first batch without one would leave its encoder untimed, and
    unplaced), and the link between ranks; the mix of modalities from those batches; the same
    ``EncoderProfile`` on every rank (collective)."""
    module = trainer.lightning_module
    loader = training_loader(trainer)
    batches = peek_batches(loader, mix_batches) or [next(iter(loader))]  # the same batches on every rank
    mixes = [carrying(module, b) for b in batches]
    richest = max(range(len(batches)), key=lambda i: sum(share > 0 for share in mixes[i].values()))
    batch = strategy.precision_plugin.convert_input(batches[richest])
    control = strategy.process_groups.control  # type: ignore[union-attr]
    role = strategy.role
    place = f"cpu{role.index}" if role.is_cpu_worker else f"device{role.index}"
    for turn in range(dist.get_world_size(control)):
        if turn == strategy.global_rank:
            times = time_encoders(module, batch, strategy.root_device, repeats)
        dist.barrier(group=control)
    link = time_link(all_reduce_over(control), torch.device("cpu"), repeats=repeats)
    parts = gather_object_to((place, times, link), 0, control)
    result: list[Any] = [None]
    if strategy.global_rank == 0:
        assert parts is not None
        profile = EncoderProfile(batch_size_of(batch), {}, parts[0][2], sorted(unplaceable_encoders(module, strategy.whole_batch_norm)))
        # The mix of modalities from more than one batch: a single batch's can be far from the data's.
        mix = {m: statistics.mean(found[m] for found in mixes) for m in mixes[0]}
        for name, timed, _ in parts:
            profile.places.setdefault(name, replace(timed, carrying=mix))  # the first node's
        result = [profile]
    dist.broadcast_object_list(result, src=0, group=control)
    return result[0]


def profile_role(role: Role) -> str:
    """The profile's name for a process's timings: ``"cpu"`` for every CPU worker (they are alike),
    ``"stage<i>"`` for a stage."""
    return "cpu" if role.is_cpu_worker else f"stage{role.index}"


def _replayed(record: StepRecord) -> float:
    """Seconds of a last stage's step spent replaying the step method (its ``compute`` spans)."""
    return sum(end - start for kind, start, end in record.spans if kind == "compute")


def _machine(strategy: "HeteroStrategy", profile: Profile) -> Machine:
    """The machine the run is on, as profiled."""
    topology = strategy.topology
    machine = Machine.as_profiled(profile, [str(d) for d in topology.stage_devices], topology.cpu_workers)
    machine.cpu_threads = strategy.plan.cpu_threads
    return machine


def _shared_cores(parts: list[dict[str, Any]], cores: int) -> dict[str, float]:
    """Per layout, the cores' worth the first node's ranks that compute on its CPU got together:
    each rank's threads, times its speed together over its speed alone (``_together``); never
    more than the node's ``cores`` (a machine whose speed drifts can seem to give more)."""
    worth: dict[str, float] = {}
    unmeasured = set()
    for part in parts:
        if part["node"] == 0:
            for layout, (threads, alone, together) in part["sharing"].items():
                if alone and together:
                    worth[layout] = worth.get(layout, 0.0) + threads * alone / together
                else:
                    unmeasured.add(layout)
    return {layout: min(value, cores) for layout, value in worth.items() if layout not in unmeasured}


def _stages(topology: Any, cores: int) -> dict[str, int]:
    """A node's stages for ``split_cores``: the cores they keep (one for a GPU stage: its driver and
    its offloaded optimizer steps; its threads for an emulated one), and how many of each kind."""
    gpu = sum(d.type == "cuda" for d in topology.stage_devices)
    emulated = len(topology.stage_devices) - gpu
    return {
        "stage_cores": gpu + emulated * max(1, cores // topology.procs_per_node),
        "emulated_stages": emulated,
        "gpu_stages": gpu,
    }


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return str(device)


def _optimizer_rate(
    optimizer: Optional[torch.optim.Optimizer], shapes: list[torch.Size], device: torch.device, fused_cpu: bool
) -> float:
    """Seconds per parameter of the user's optimizer on ``device`` (its fused CPU form if asked),
    stepping parameters of the model's shapes."""
    if optimizer is None:
        return 0.0
    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "lr"}
    if fused_cpu:
        if "fused" not in accepted:
            return time_optimizer(type(optimizer), device, shapes=shapes, **kwargs)
        kwargs.update(fused=True, foreach=None)
    return time_optimizer(type(optimizer), device, shapes=shapes, **kwargs)
