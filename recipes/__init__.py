"""LightningCLI recipes for lightning-hetero: models and data that follow the hetero model
contract, run as ``python -m recipes.<name> fit --config configs/<file>.yaml`` or ``hetero fit
--config configs/<file>.yaml``."""
