"""A policy per phase on the command line: ``policy.prefill=<name>`` and ``policy.decode=<name>`` name policies of
``configs/policy/``, each composed as ``policy=<name>`` would compose it, where the run finds its configs.

A name, not a nested config, so that a sweep (``-m policy.decode=h2o,window``) and a cell's directory
(``snapkv/decode=h2o``) read as the command line does. A variant with other options is a config file of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

from kvbench.config.spec import ConfigError
from kvbench.stages import Stage

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
PHASES = ("prefill", "decode")


def composed(config_name: str, overrides: tuple[str, ...], searchpath: tuple[str, ...] = ()) -> dict[str, Any]:
    """The config Hydra composes from these overrides and nothing else, finding config files where the run found
    them (``hydra.searchpath``); Hydra must be initialised."""
    quoted = ",".join("'" + path.replace("'", "\\'") + "'" for path in searchpath)
    extra = [f"hydra.searchpath=[{quoted}]"] if searchpath else []
    plain = OmegaConf.to_container(compose(config_name, overrides=[*overrides, *extra]), resolve=True)
    assert isinstance(plain, dict)  # a composed config is a mapping
    return {str(key): value for key, value in plain.items()}


def named_policy(name: str) -> dict[str, Any]:
    """``configs/policy/<name>.yaml`` over the schema's policy defaults, as the running job (or, outside one,
    kvbench's own ``configs/``) composes it; ``ConfigError`` listing the policies when there is none."""
    try:
        if HydraConfig.initialized():
            hydra = HydraConfig.get()
            config = composed(str(hydra.job.config_name), (f"policy={name}",), tuple(str(p) for p in hydra.searchpath))
        elif GlobalHydra.instance().is_initialized():
            config = composed("config", (f"policy={name}",))
        else:
            with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
                config = composed("config", (f"policy={name}",))
    except MissingConfigException as err:
        options = ", ".join(err.options or []) if getattr(err, "options", None) else "configs/policy/*.yaml"
        raise ConfigError(f"{name!r} is not a policy; choose one of {options}") from None
    return dict(config["policy"])


def resolve_phases(policy: dict[str, Any], stage: Stage) -> dict[str, Any]:
    """``policy`` with each named phase policy replaced by its config; refused outside stage=both."""
    named = {phase: policy[phase] for phase in PHASES if policy.get(phase) is not None}
    if not named:
        return policy
    given = " ".join(f"policy.{phase}={name}" for phase, name in named.items())
    if stage is not Stage.both:
        raise ConfigError(
            f"{given} names a policy per phase, which needs stage=both (stage={stage} evicts in one phase: name "
            "that policy with policy=... instead)"
        )
    if policy.get("name") == "full":  # the run's policy= is the other phase's, and the cache's layout
        other = "decode" if "prefill" in named else "prefill"
        example = (
            f"policy={named['prefill']} policy.decode={named['decode']}"
            if len(named) == 2
            else f"policy=<the {other} phase's policy> {given}"
        )
        raise ConfigError(
            f"{given} needs the run's own policy=NAME: it rules the other phase and gives the cache its allocation "
            f"and extras (the default policy=full evicts in neither phase); e.g. {example}"
        )
    out = dict(policy)
    for phase, name in named.items():
        try:
            out[phase] = named_policy(name)
        except ConfigError as err:
            raise ConfigError(f"policy.{phase}={name}: {err}") from None
    return out
