"""The run config: its schema (``schema``), its defaults in Hydra's ConfigStore (``store``), and ``validate``,
which turns a composed config into a ``RunSpec`` or one ``ConfigError`` naming the fix."""

from kvbench.config.spec import ConfigError, RunSpec
from kvbench.config.store import register
from kvbench.config.validate import validate, validate_engine

register()

__all__ = ["ConfigError", "RunSpec", "validate", "validate_engine"]
