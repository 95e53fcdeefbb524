"""Hydra's ConfigStore holds the schema's defaults, so that no YAML file repeats them.

configs/config.yaml lists ``base/run`` at the top level and ``base/model``, ``base/policy`` and ``base/task``
under their groups' packages, before the chosen group files: a policy file states only what it chooses, and
``policy.quantize=int8`` works on every policy because the key is there. The nodes are left untyped: a value
of the wrong type then reaches ``validate``, whose message names the fix, instead of stopping Hydra's
composition with OmegaConf's wording (and, in a sweep, every cell with it).
"""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from kvbench.config.schema import ModelConfig, PolicyConfig, RunSettings, TaskConfig

BASES: dict[str, type] = {"run": RunSettings, "model": ModelConfig, "policy": PolicyConfig, "task": TaskConfig}


def defaults_node(schema: type) -> DictConfig:
    """The dataclass's defaults as a plain node (enums as their strings, required fields as ``???``)."""
    plain: Any = OmegaConf.to_container(OmegaConf.structured(schema), enum_to_str=True)
    return OmegaConf.create(plain)


def register() -> None:
    store = ConfigStore.instance()
    for name, schema in BASES.items():
        store.store(group="base", name=name, node=defaults_node(schema))
