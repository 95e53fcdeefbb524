"""The config package: the schema's defaults reach every composed config through Hydra's ConfigStore, the group
files do not restate them, every value a preset sweeps reads against the schema, and RunSpec holds plain values."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from conftest import CONFIG_DIR
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import kvbench.run  # noqa: F401  (registers the resolver the hydra section uses)
from kvbench.config import ConfigError, validate
from kvbench.config.read import read_run
from kvbench.config.schema import ModelConfig, PolicyConfig, Stage

TINY = ["model=tiny-llama", "task.n=2", "task.context_tokens=96", "task.max_new_tokens=3"]
POLICIES = sorted(p.stem for p in (CONFIG_DIR / "policy").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
# What a group file is for: the keys that make one policy (or model) differ from another.
DEFINING = {"policy": {"name", "score", "scope"}, "model": {"name", "source", "embedded", "name_or_path"}}


@pytest.fixture
def hydra_configs():
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        yield


def test_every_policy_gets_the_extras_and_takes_their_overrides(hydra_configs):
    for name in POLICIES:
        cfg = compose("config", overrides=[*TINY, f"policy={name}"])
        own = yaml.safe_load((CONFIG_DIR / "policy" / f"{name}.yaml").read_text())
        merges, positions = own.get("merge", False), own.get("positions", "absolute")  # Finch's re-indexes
        assert (cfg.policy.merge, cfg.policy.quantize, cfg.policy.positions) == (merges, "none", positions), name
        changed = compose(
            "config", overrides=[*TINY, f"policy={name}", "policy.quantize=int8", "policy.positions=reindex"]
        )
        assert (changed.policy.quantize, changed.policy.positions) == ("int8", "reindex"), name


@pytest.mark.parametrize("group, schema", [("policy", PolicyConfig), ("model", ModelConfig)])
def test_group_files_do_not_restate_the_schema_defaults(group, schema):
    defaults = {f.name: f.default for f in dataclasses.fields(schema)}
    for path in sorted((CONFIG_DIR / group).glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        restated = [k for k, v in data.items() if k not in DEFINING[group] and k in defaults and v == defaults[k]]
        assert not restated, f"{path.name} restates the default of {restated} (kvbench/config/schema.py has it)"


def sweep_cells(experiment: str) -> list[list[str]]:
    """Cells of a preset's sweep grid that between them take every value of every swept key (the others at
    their first value): the product itself runs to hundreds of cells, each a composition."""
    base = compose("config", overrides=[f"experiment={experiment}"], return_hydra_config=True)
    params = OmegaConf.to_container(base.hydra.sweeper.params) if "params" in base.hydra.sweeper else {}
    grid = {key: str(values).split(",") for key, values in params.items()}
    first = {key: values[0] for key, values in grid.items()}
    cells = {tuple(sorted({**first, key: value}.items())) for key, values in grid.items() for value in values}
    return [[f"experiment={experiment}", *(f"{k}={v}" for k, v in cell)] for cell in sorted(cells)]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_swept_value_of_every_preset_reads_against_the_schema(hydra_configs, experiment):
    cells = sweep_cells(experiment)
    assert cells
    for overrides in cells:
        data = OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)
        run = read_run(data)
        assert isinstance(run.stage, Stage) and run.stage == data["stage"]


def test_run_spec_holds_plain_values(hydra_configs):
    spec = validate(compose("config", overrides=[*TINY, "policy=h2o", "budget=64", "stage=decode"]))
    assert type(spec.stage) is str and spec.stage == "decode"
    assert spec.budget == 64 and type(spec.budget) is int
    assert spec.policy_cfg["quantize"] == "none" and type(spec.policy_cfg["quantize"]) is str
    for part in (spec.model, spec.policy_cfg, spec.task_cfg, spec.sampling, spec.capacity, spec.tracking):
        yaml.safe_dump(part)  # no enums or other objects: YAML and JSON writers take them as they are
    assert spec.model["dtype"] == "float32" and spec.tracking["wandb"]["mode"] == "disabled"


def test_a_key_the_schema_does_not_know_is_named(hydra_configs):
    with pytest.raises(ConfigError, match=r"^sampling.foo is not a kvbench setting; remove it"):
        validate(compose("config", overrides=[*TINY, "+sampling.foo=1"]))
