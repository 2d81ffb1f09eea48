"""The model contract, and the ``PipelineModule`` mixin that derives the Lightning steps from it.

Any LightningModule trains with the hetero strategy as it is, as *replicas*: every device of the
layout holds the whole model and runs the module's own ``training_step`` on its share of every
batch (``check_replica_contract``). To be pipelined, a LightningModule provides

- ``pipeline_layers() -> Sequence[nn.Module]``: the model as an ordered list of blocks, each the
  input of the next, every trainable parameter in at least one block (a parameter two blocks use,
  such as tied input and output embeddings, may land on two stages: ``tied_parameters``); a block
  is a submodule of the model or a thin wrapper over some of them; and
- ``pipeline_loss(output, target) -> Tensor``: the loss, a mean over the samples of the batch.

The pipeline stages run slices of ``pipeline_layers()`` and ``pipeline_loss``; the CPU worker runs
the module's own ``training_step``. ``PipelineModule`` derives ``forward`` and the step methods
from the two, so both paths compute the same thing by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

__all__ = [
    "PipelineModule",
    "run_layers",
    "split_inputs_targets",
    "inputs_of",
    "pipeline_pair",
    "pipeline_inputs_only",
    "offers_blocks",
    "check_model_contract",
    "check_replica_contract",
    "check_optimizers",
    "layer_names",
    "tied_parameters",
    "buffer_versions",
    "parameter_versions",
    "check_copies_agree",
]


def run_layers(layers: Sequence[nn.Module], inputs: Any) -> Any:
    """Feed ``inputs`` through ``layers`` in order; a tuple output is unpacked into the next layer."""
    for layer in layers:
        inputs = layer(*inputs) if isinstance(inputs, tuple) else layer(inputs)
    return inputs


def split_inputs_targets(batch: Any) -> tuple[Any, Any]:
    """A batch is ``(inputs, targets)``; say so clearly when it is not."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    kind = f"a {type(batch).__name__} of length {len(batch)}" if isinstance(batch, (tuple, list)) else repr(type(batch))
    raise TypeError(
        f"The hetero strategy expects every batch to be a pair `(inputs, targets)`, but got {kind}."
        " Make your dataset or collate_fn return `(inputs, targets)`."
    )


def inputs_of(batch: Any) -> Any:
    """The inputs of a batch: the first item of ``(inputs, targets)`` or ``(inputs,)``, or the batch itself."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def pipeline_pair(model: Any, batch: Any) -> tuple[Any, Any]:
    """What feeds the first block and what the loss's target is, for a batch: the model's
    ``pipeline_inputs(batch)``, or ``(inputs, targets)`` as the batch gives them."""
    hook = getattr(model, "pipeline_inputs", None)
    return hook(batch) if callable(hook) else split_inputs_targets(batch)


def pipeline_inputs_only(model: Any, batch: Any) -> Any:
    """What feeds the first block, for a batch that may have no targets (prediction)."""
    return pipeline_pair(model, batch)[0] if _defines(model, "pipeline_inputs") else inputs_of(batch)


class PipelineModule:
    """Mixin for a ``LightningModule`` that is an ordered list of blocks.

    Implement ``pipeline_layers()`` and ``pipeline_loss(output, target)``; ``forward``,
    ``training_step``, ``validation_step``, ``test_step`` and ``predict_step`` follow from them and
    log ``train_loss`` / ``val_loss`` / ``test_loss``. List it before ``LightningModule``::

        class Net(PipelineModule, L.LightningModule):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList([nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2)])

            def pipeline_layers(self):
                return list(self.layers)

            def pipeline_loss(self, output, target):
                return nn.functional.cross_entropy(output, target)
    """

    def pipeline_layers(self) -> Sequence[nn.Module]:
        raise NotImplementedError(f"{type(self).__name__} must implement `pipeline_layers()`.")

    def pipeline_loss(self, output: Any, target: Any) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement `pipeline_loss(output, target)`.")

    def pipeline_inputs(self, batch: Any) -> tuple[Any, Any]:
        """What of a batch feeds the first block, and what the loss's target is: ``(inputs, target)``.
        The default takes batches that are ``(inputs, targets)``; override it for any other
        structure (a dict, a dataclass, a tokenizer's output). ``inputs`` may be a tensor, a tuple
        (the first block's positional arguments) or a dict (its one argument); the target may be
        anything ``pipeline_loss`` takes, or ``None`` where a batch has none (prediction)."""
        return split_inputs_targets(batch)

    def forward(self, inputs: Any) -> Any:
        return run_layers(self.pipeline_layers(), inputs)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._pipeline_step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return self._pipeline_step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return self._pipeline_step(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self(pipeline_inputs_only(self, batch))

    def _pipeline_step(self, batch: Any, stage: str) -> Tensor:
        inputs, targets = self.pipeline_inputs(batch)
        loss = self.pipeline_loss(self(inputs), targets)
        self.log(f"{stage}_loss", loss, prog_bar=True)  # type: ignore[attr-defined]
        return loss


def offers_blocks(model: nn.Module) -> bool:
    """Whether the model offers itself as blocks to pipeline: it has a ``pipeline_layers()`` of its own."""
    return _defines(model, "pipeline_layers")


def _defines(model: nn.Module, method: str) -> bool:
    return callable(getattr(model, method, None)) and getattr(type(model), method, None) is not getattr(
        PipelineModule, method
    )


def _running_stats(module: nn.Module) -> bool:
    return isinstance(module, _NormBase) and module.track_running_stats


def buffer_versions(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Each buffer's identity and version (which a write in place bumps), by name, BatchNorm's left out
    (the strategy keeps their statistics equal: ``batchnorm.py``), and those of other ranks' layers (meta)."""
    versions = {}
    for path, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            continue
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and not buffer.is_meta:
                versions[f"{path}.{name}" if path else name] = (id(buffer), buffer._version)
    return versions


def parameter_versions(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Each parameter's identity and version (which a write in place bumps), by name, those of other
    ranks' layers (meta) left out."""
    return {name: (id(p), p._version) for name, p in model.named_parameters() if not p.is_meta}


def check_copies_agree(model: nn.Module, group: Any) -> None:
    """Every process's copy of every parameter it holds is the same, as the strategy made them (a
    collective over ``group``, every rank; at the first training batch). Compared by each
    parameter's sum of squares in float64, to rounding (a GPU sums in another order): a hook that
    changes parameters differently on different processes (a random re-initialization in
    ``on_train_start``, which draws from each process's own random stream, and which a pipeline
    stage makes only for the layers it holds) would leave copies that never meet again, since
    every step adds the same summed gradient to each."""
    params = list(model.named_parameters())
    held = [p.detach().double().square().sum() for _, p in params if not p.is_meta]
    sums = torch.full((len(params),), float("nan"), dtype=torch.float64)
    if held:
        sums[torch.tensor([not p.is_meta for _, p in params])] = torch.stack(held).cpu()  # one read of the device
    every = [torch.empty_like(sums) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, sums, group=group)
    table = torch.stack(every)  # ranks x parameters
    low, high = table.nan_to_num(nan=float("inf")).min(0).values, table.nan_to_num(nan=float("-inf")).max(0).values
    apart = [
        name
        for (name, _), lo, hi, seen in zip(params, low.tolist(), high.tolist(), (~table.isnan()).sum(0).tolist())
        if seen > 1 and hi - lo > 1e-6 * max(abs(hi), abs(lo)) + 1e-12
    ]
    if apart:
        raise RuntimeError(
            f"The processes' copies of the parameter(s) {apart[:5]}{' ...' if len(apart) > 5 else ''} differ at the"
            " first training batch, where the strategy started them equal: a hook before it (`on_fit_start`,"
            " `on_train_start`, `on_train_epoch_start`, `on_train_batch_start`, or a callback's) changed them"
            " differently on different processes, such as a random re-initialization, which draws from each"
            " process's own random stream (and on a pipeline stage only for the layers it holds). The copies would"
            " never meet again. Initialize parameters in `__init__`, `setup` or `configure_model`, which every"
            " process runs alike on the whole model."
        )


def check_replica_contract(model: nn.Module) -> list[nn.Module]:
    """Check that the model can train as replicas; return its parameter blocks: each module's own
    parameters (not its children's), in the order the model registers them, every parameter once
    (a parameter two modules share belongs to the first, whose backward finishes it: fine mode's
    buckets follow these blocks)."""
    _check_training(model)
    # BatchNorm's running statistics are kept equal between the replicas (`batchnorm.py`); others' are not.
    stats = [type(m).__name__ for m in model.modules() if _running_stats(m) and not isinstance(m, _BatchNorm)]
    if stats:
        raise ValueError(
            f"`{type(model).__name__}` contains {stats[0]} with running statistics, which the hetero strategy does"
            " not keep equal between replicas (it does BatchNorm's). Use `track_running_stats=False`."
        )
    seen: set[int] = set()
    blocks = []
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            blocks.append(_Block(own))
    return blocks


class _Block(nn.Module):
    """One module's own parameters, as a block of a replica (the same parameter objects)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(params)


def check_model_contract(model: nn.Module, pipeline: bool = True) -> list[nn.Module]:
    """Return ``model.pipeline_layers()`` after checking the contract; raise a clear error otherwise.
    ``pipeline=False``: only what blocks are (for replicas, which profile a model's blocks but run
    its own step), leaving out what only a pipeline needs (no `backward` of its own, no running
    statistics in a block)."""
    name = type(model).__name__
    hint = (
        "Define `pipeline_layers()` (the model as an ordered list of blocks) and `pipeline_loss(output, target)`"
        " on your LightningModule, or inherit from `lightning_hetero.PipelineModule`; or train it as it is, as"
        " replicas (`parallelism='replicas'`)."
    )
    for method in ("pipeline_layers", "pipeline_loss"):
        if not _defines(model, method):
            raise TypeError(f"`{name}` does not follow the hetero model contract: it has no `{method}()`. {hint}")
    _check_training(model)
    if pipeline and isinstance(model, LightningModule) and is_overridden("backward", model):
        raise ValueError(
            f"`{name}` overrides `backward`, which a pipeline cannot call: its stages run the backward of"
            " `pipeline_loss` micro-batch by micro-batch (torch's schedule). Train it as replicas"
            " (`parallelism='replicas'`), where every worker calls your `backward`, or leave `backward` to Lightning."
        )
    if pipeline and isinstance(model, LightningModule) and not is_overridden("forward", model):
        raise TypeError(
            f"`{name}` has no `forward`: a pipeline's last stage runs your step methods with `self(inputs)` answered"
            " by the pipeline's output, so they must compute the model's output with one `self(inputs)` call. Define"
            " `forward` (the blocks in order; `lightning_hetero.PipelineModule` gives one), or train the model as it"
            " is, as replicas (`parallelism='replicas'`)."
        )
    layers = model.pipeline_layers()
    if not isinstance(layers, (list, tuple, nn.ModuleList, nn.Sequential)):
        raise TypeError(f"`{name}.pipeline_layers()` must return a list of modules, got {type(layers).__name__}.")
    layers = list(layers)
    if not layers:
        raise ValueError(f"`{name}.pipeline_layers()` returned no layers.")
    own = {id(p) for p in model.parameters()}
    submodules = {id(m) for m in model.modules()}
    seen: set[int] = set()
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"`{name}.pipeline_layers()[{i}]` is a {type(layer).__name__}, not an nn.Module.")
        # A block is one of the model's submodules, or a thin wrapper over some of them (a step of
        # a library's model, such as its embedding): either way its parameters are the model's.
        foreign = id(layer) not in submodules and (
            not any(id(m) in submodules for m in layer.modules()) or any(id(p) not in own for p in layer.parameters())
        )
        if foreign:
            raise ValueError(
                f"`{name}.pipeline_layers()[{i}]` ({type(layer).__name__}) is not a submodule of the model, nor a"
                " wrapper over its submodules; assign the layers to attributes (e.g. an nn.ModuleList) so the model"
                " owns their parameters."
            )
        if id(layer) in seen:
            raise ValueError(f"`{name}.pipeline_layers()` lists the same module twice (index {i}).")
        seen.add(id(layer))
        stats = [type(m).__name__ for m in layer.modules() if _running_stats(m)]
        if stats and pipeline:
            raise ValueError(
                f"`{name}.pipeline_layers()[{i}]` contains {stats[0]} with running statistics, which a pipeline"
                " does not keep between its workers. Train it as replicas (`parallelism='replicas'`: BatchNorm"
                " works there), or use LayerNorm/GroupNorm or `track_running_stats=False`."
            )
    _check_parameter_ownership(model, layers)
    return layers


def _check_training(model: nn.Module) -> None:
    """What any model needs to train with the strategy: automatic optimization, and a ``training_step``
    that takes a batch and its index."""
    name = type(model).__name__
    if getattr(model, "automatic_optimization", True) is False:
        raise ValueError(
            f"`{name}` uses manual optimization, which the hetero strategy does not support: the strategy runs"
            " the backward pass and the gradient sync itself. Keep `automatic_optimization = True`."
        )
    sparse = [
        n
        for n, m in model.named_modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad
    ]
    if sparse:
        raise ValueError(
            f"`{name}.{sparse[0]}` makes sparse gradients (`sparse=True`), which the hetero strategy does not sum"
            " between its workers. Use `sparse=False` (and a dense optimizer such as Adam in place of `SparseAdam`)."
        )
    lazy = [n for n, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise ValueError(
            f"`{name}` has lazy layers whose parameters have no shape until a first forward ({', '.join(lazy[:3])}"
            f"{' ...' if len(lazy) > 3 else ''}): the hetero strategy lays out the gradients it sums from the"
            " parameters' shapes before training, as DDP does. Give the layers their sizes (`nn.Linear` for"
            " `nn.LazyLinear`), or run a batch through the model in `configure_model` so they have them."
        )
    step = getattr(model, "training_step", None)
    if callable(step) and (
        is_param_in_hook_signature(step, "dataloader_iter", explicit=True)
        or not is_param_in_hook_signature(step, "batch_idx", min_args=2)
    ):
        raise TypeError(
            f"`{name}.training_step` must take `(batch, batch_idx)`: the strategy divides each batch between its"
            " workers and counts batches for gradient accumulation, so a step that takes a `dataloader_iter`, or"
            " no `batch_idx`, cannot run."
        )


def _check_parameter_ownership(model: nn.Module, layers: list[nn.Module]) -> None:
    name = type(model).__name__
    held = {id(p) for layer in layers for p in layer.parameters()}
    orphans = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if orphans:
        shown = ", ".join(orphans[:5]) + (" ..." if len(orphans) > 5 else "")
        raise ValueError(
            f"`{name}` has trainable parameters outside `pipeline_layers()`: {shown}. Every trainable parameter"
            " must belong to one of the layers, or the pipeline stages would never train it."
        )


def tied_parameters(
    layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]]
) -> list[tuple[tuple[int, ...], list[nn.Parameter]]]:
    """The parameters that the blocks of several stages use (tied weights: an input embedding and
    the output head), grouped by the stages that hold them: ``(stages, params)`` in the order the
    blocks first use them. Each of these stages computes its own uses' gradient, and the sum is
    what every copy steps with (``workers.Placement``)."""
    holders: dict[nn.Parameter, list[int]] = {}
    for stage, (start, stop) in enumerate(bounds):
        for layer in layers[start:stop]:
            for p in layer.parameters():
                stages = holders.setdefault(p, [])
                if stage not in stages:
                    stages.append(stage)
    tied: dict[tuple[int, ...], list[nn.Parameter]] = {}
    for p, stages in holders.items():
        if len(stages) > 1:
            tied.setdefault(tuple(stages), []).append(p)
    return list(tied.items())


def check_fine_clipping(model: Any) -> None:
    """Fine mode clips each bucket as its gradients complete: a ``configure_gradient_clipping``
    override is refused (before any process starts, and in each process for a model built there)."""
    if is_overridden("configure_gradient_clipping", model):
        raise ValueError(
            f"`{type(model).__name__}` overrides `configure_gradient_clipping`, which fine mode cannot call: it"
            " clips each bucket as its gradients complete. Use the Trainer's `gradient_clip_val` and"
            " `gradient_clip_algorithm`, or `mode='coarse'`."
        )


def check_optimizers(model: Any, optimizers: Sequence[Optimizer], mode: str, callbacks: Sequence[Any] = ()) -> None:
    """The optimizers ``configure_optimizers`` gave, for the hetero strategy in ``mode``; raise a
    clear error where they cannot train (found in each process, at setup). State made in their
    constructors for the layers this process does not hold is dropped. In fine mode, the hooks of
    the model and of the Trainer's ``callbacks`` that it does not follow as one process are named."""
    for optimizer in (getattr(o, "_optimizer", o) for o in optimizers):
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "LBFGS re-evaluates the loss inside `optimizer.step` and treats all parameters as one vector,"
                " which the hetero strategy cannot split between its workers (each computes a share of the batch,"
                " and a pipeline's stages hold parts of the model). Use a first-order optimizer."
            )
        # State an optimizer made in its constructor (Adagrad's sums) for the layers other stages
        # hold is on the meta device with them: those stages keep it, not this one.
        for param in [p for p in optimizer.state if p.is_meta]:
            del optimizer.state[param]
    if mode != "fine":
        return
    check_fine_clipping(model)
    if len(optimizers) != 1:
        raise ValueError(f"Fine mode steps one optimizer bucket by bucket; `configure_optimizers` gave {len(optimizers)}.")
    owners = [(f"`{type(model).__name__}`", model, None), *((f"The callback `{type(c).__name__}`", c, Callback) for c in callbacks)]
    for owner, hooked, parent in owners:
        unfollowed = [f"`{hook}` {what}" for hook, what in _FINE_MODE_HOOKS.items() if _overrides(hooked, hook, parent)]
        if unfollowed:
            rank_zero_warn(
                f"{owner} overrides hooks that fine mode does not follow as one process does: it sums and steps each"
                f" bucket of gradients during the backward, so {'; '.join(unfollowed)}. Use `mode='coarse'` where a"
                " hook must see or decide the whole optimizer step (docs/fine-mode.md)."
            )


def _overrides(hooked: Any, hook: str, parent: Any) -> bool:
    """Whether a model (``parent`` None) or a callback overrides ``hook``, where it has one."""
    if parent is None:
        return is_overridden(hook, hooked)
    return hasattr(parent, hook) and is_overridden(hook, hooked, parent=parent)


_FINE_MODE_HOOKS = {
    "optimizer_step": (
        "runs after the buckets have stepped (skipping `optimizer.step()` there skips nothing, and a learning rate"
        " set there, as a warm-up by hand, applies from the next step)"
    ),
    "optimizer_zero_grad": "runs after the buckets have consumed their gradients (none is left to keep)",
    "on_after_backward": "sees no gradients at an optimizer step's last batch (the buckets consumed them)",
    "on_before_optimizer_step": (
        "runs after the buckets have stepped: it sees no gradients (the buckets consumed them), and a learning"
        " rate set there applies from the next step"
    ),
}


def layer_names(model: nn.Module, layers: Sequence[nn.Module]) -> list[str]:
    """Each layer's module name in the model (``"layers.3"``), as plans name stage boundaries; a
    wrapper over the model's submodules goes by its first one's name."""
    names = {id(m): name for name, m in model.named_modules()}
    return [next(names[id(m)] for m in layer.modules() if id(m) in names) for layer in layers]
