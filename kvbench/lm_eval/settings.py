"""lm-eval's ``--model_args`` as kvbench settings: each ``key=value`` is a Hydra override of kvbench's config
(``model=smollm2-135m``, ``policy=snapkv``, ``budget=0.25``, ``policy.score.window=16``), composed as
``kvbench-run`` composes a cell and checked by ``validate_engine`` before any weights load.

What lm-eval decides (the tasks, the prompts, how long to generate and how to sample) is not a kvbench setting
here: those keys are refused with the lm-eval option that does their job.
"""

from __future__ import annotations

from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf

from kvbench.config import ConfigError, RunSpec, validate_engine
from kvbench.config.phases import CONFIG_DIR

# kvbench-run settings with no meaning under lm-eval, and what does their job there.
LM_EVAL_OWNS = {
    "task": "lm-eval's --tasks",
    "experiment": "lm-eval's --tasks and --model_args (a preset is a kvbench-run sweep)",
    "max_new_tokens": "the task's generation_kwargs (or lm-eval's --gen_kwargs max_gen_toks=N)",
    "sampling": "the task's generation_kwargs (or lm-eval's --gen_kwargs do_sample=true,temperature=T)",
    "fidelity": "a kvbench-run cell (task=... fidelity=true)",
    "capacity": "a kvbench-run cell (experiment=capacity)",
    "tracking": "lm-eval's --wandb_args",
    "results_dir": "lm-eval's --output_path",
    "sweep_name": "lm-eval's --output_path",
    "print_table": "lm-eval, which prints its own table",
}


def override(key: str, value: Any) -> str:
    """One model argument as a Hydra override; lm-eval has already typed the value (0.25, 8, True)."""
    if isinstance(value, bool):
        value = "true" if value else "false"
    return f"{key}={value}"


def refuse_lm_eval_keys(model_args: dict[str, Any]) -> None:
    """``ConfigError`` for a kvbench-run setting that lm-eval decides instead, naming what does its job."""
    for key in model_args:
        root = key.split(".")[0].lstrip("+~")
        if root in LM_EVAL_OWNS:
            use = LM_EVAL_OWNS[root]
            raise ConfigError(f"--model_args {key}=... is a kvbench-run setting; under lm-eval use {use}")


def run_spec(model_args: dict[str, Any]) -> RunSpec:
    """The validated settings of ``--model_args`` (already parsed by lm-eval), or one ``ConfigError``."""
    refuse_lm_eval_keys(model_args)
    overrides = [override(key, value) for key, value in model_args.items()]
    try:
        if GlobalHydra.instance().is_initialized():
            cfg = compose("config", overrides=overrides)
        else:
            with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
                cfg = compose("config", overrides=overrides)
    except HydraException as err:
        raise ConfigError(f"--model_args {','.join(overrides)}: {_explain(err)}") from None
    data = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(data, dict)  # a composed config is a mapping
    data.pop("hydra", None)
    return validate_engine(OmegaConf.create(data))


def _explain(err: HydraException) -> str:
    """Hydra's first line, with the choices when a config file is missing and the fix when a key is unknown."""
    lines = str(err).strip().splitlines()
    first = lines[0] if lines else type(err).__name__
    if isinstance(err, MissingConfigException) and err.options:
        return f"{first}; choose one of {', '.join(err.options)}"
    if first.startswith("Could not override"):
        return f"{first} It is not a kvbench setting (they are in kvbench/config/schema.py, e.g. model.dtype=float32)"
    return first
