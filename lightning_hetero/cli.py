"""The command line: LightningCLI with the hetero strategy's conventions.

``hetero fit --config configs/mlp.yaml`` runs any recipe whose config names its model and data
classes (``class_path``); ``python -m recipes.<name> fit --config ...`` runs one recipe, whose
classes are the defaults. Configs are read in jsonargparse's ``omegaconf+`` mode, so values that
must agree can interpolate each other (``${data.init_args.batch_size}``), resolved once the
configs and the flags are all read: a flag that changes a value changes every value that follows
it. Every option of the strategy and the callbacks can be set in YAML or as a flag
(``--trainer.strategy.init_args.cpu_fraction 0.3``).
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import jsonargparse
import lightning as L
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info

import lightning_hetero  # noqa: F401  (registers strategy="hetero")
from lightning_hetero.strategy import _LAYOUT_DEFAULTS, HeteroStrategy

__all__ = ["HeteroCLI", "main"]


class HeteroCLI(LightningCLI):
    """``LightningCLI`` in subclass mode for the model and the data, resolving the configs' omegaconf
    interpolations after the command line (``omegaconf+``; an interpolation names its value from
    the config's top, ``${trainer.default_root_dir}``, as in a config read alone)."""

    def __init__(
        self,
        model_class: Optional[type[L.LightningModule]] = None,
        datamodule_class: Optional[type[L.LightningDataModule]] = None,
        args: Any = None,
        run: bool = True,
        **kwargs: Any,
    ) -> None:
        self._default_model, self._default_data = model_class, datamodule_class
        kwargs.setdefault("parser_kwargs", {"parser_mode": "omegaconf+"})
        # Under a subcommand a config sits below the parser's top (`fit.trainer...`): its absolute
        # interpolations are read as relative to it, as omegaconf mode read them.
        jsonargparse.set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(
            L.LightningModule,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            run=run,
            **kwargs,
        )

    def before_instantiate_classes(self) -> None:
        """A plan given to the strategy (``--trainer.strategy.init_args.plan plan.yaml``) is the run's
        layout: the layout arguments a config also sets are left to it, and said so."""
        strategy = self._strategy_config()
        init = strategy.get("init_args") if strategy is not None else None
        if init is None or init.get("plan") is None or not issubclass(_class(strategy.class_path), HeteroStrategy):
            return
        reset = sorted(name for name, default in _LAYOUT_DEFAULTS.items() if name in init and init[name] != default)
        for name in reset:
            init[name] = _LAYOUT_DEFAULTS[name]
        if reset:
            rank_zero_info(f"hetero: the plan {init['plan']} sets the layout; the config's {reset} are left to it")

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError:
            # jsonargparse reports a strategy's own error inside a dump of every type the option takes:
            # where the strategy refuses its arguments, its message alone says what is wrong.
            refused = self._strategy_error()
            if refused is None:
                raise
            raise type(refused)(f"--trainer.strategy: {refused}") from None

    def _strategy_config(self) -> Any:
        """``trainer.strategy`` as configured, where it names a class (``None`` for a string such as "hetero")."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        strategy = config.get("trainer.strategy")
        return strategy if isinstance(getattr(strategy, "class_path", None), str) else None

    def _strategy_error(self) -> Optional[Exception]:
        """The error the configured strategy class raises for its arguments, if it does."""
        strategy = self._strategy_config()
        if strategy is None:
            return None
        try:
            cls = _class(strategy.class_path)
            cls(**(strategy.init_args.as_dict() if strategy.get("init_args") else {}))
        except (ValueError, TypeError, OSError) as error:
            return error
        except Exception:
            return None
        return None

    def add_arguments_to_parser(self, parser: Any) -> None:
        # A recipe's own classes are the defaults, so its configs may leave out their class paths.
        if self._default_model is not None:
            parser.set_defaults({"model": {"class_path": _path(self._default_model)}})
        if self._default_data is not None:
            parser.set_defaults({"data": {"class_path": _path(self._default_data)}})


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def main(args: Any = None) -> None:
    """The ``hetero`` console script."""
    HeteroCLI(args=args)


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
