"""The one registry: every kind of named part uses it, modules are found without a list, a name is taken once."""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import REPO, registries

import kvbench
from kvbench.metrics.registry import register_metric
from kvbench.policies.base import Score
from kvbench.policies.parts import SCORES, register_score
from kvbench.policies.state import TokenState
from kvbench.registry import Registry
from kvbench.tasks.registry import register_task
from kvbench.tasks.retrieval import RetrievalTask


def kvbench_modules() -> Iterator[object]:
    for info in pkgutil.walk_packages(kvbench.__path__, "kvbench."):
        yield importlib.import_module(info.name)


def test_every_registry_is_the_one_class() -> None:
    """Scores, scopes, allocations, quantisers, tasks and metrics: one ``Registry`` each, no other mechanism (a
    module-level table of classes by name would be one)."""
    found = {id(value): value for module in kvbench_modules() for value in vars(module).values()}
    held = [value for value in found.values() if isinstance(value, Registry)]
    assert {id(r) for r in held} == {id(r) for r in registries()}
    assert all(type(r) is Registry for r in held)
    tables = [
        f"{module.__name__}.{name}"
        for module in kvbench_modules()
        for name, value in vars(module).items()
        if isinstance(value, dict) and value and all(isinstance(v, type) for v in value.values())
    ]
    assert tables == ["kvbench.config.store.BASES"]  # Hydra's schema node per config group, not a registry


def test_a_name_registered_twice_is_refused_naming_both_places() -> None:
    @register_score("registry_test_twice")
    class First(Score):
        def __call__(self, state: TokenState) -> torch.Tensor:
            return state.positions.float()

    class Second(First):
        pass

    with pytest.raises(ValueError) as refused:
        register_score("registry_test_twice")(Second)
    message = str(refused.value)
    assert f"{__name__}.{First.__qualname__}" in message and f"{__name__}.{Second.__qualname__}" in message
    assert SCORES.get("registry_test_twice") is First

    with pytest.raises(ValueError, match=r"task 'retrieval' is already registered by .*RetrievalTask; .*Copy"):

        @register_task("retrieval")
        class Copy(RetrievalTask):
            pass

    register_metric("registry_test_metric", higher_is_better=True)
    with pytest.raises(ValueError) as refused:
        register_metric("registry_test_metric", higher_is_better=False)
    places = re.fullmatch(
        rf"metric .* already registered by {__name__}:(\d+); {__name__}:(\d+) registers .*", str(refused.value)
    )
    assert places and int(places[2]) == int(places[1]) + 2  # the two lines above


WIDGETS = """
from kvbench.registry import Registry

WIDGETS = Registry("widget", (__name__,))
"""
WIDGET = """
from {package} import WIDGETS


@WIDGETS.register("{name}")
class Widget:
    label = "{label}"
"""


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An importable package of its own in ``tmp_path`` (``registry_test_pkg``), gone again afterwards."""
    root = tmp_path / "registry_test_pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text(WIDGETS)
    (root / "sub" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [m for m in sys.modules if m.split(".")[0] == "registry_test_pkg"]:
        del sys.modules[name]


def test_modules_dropped_in_a_package_are_found_when_the_registry_is_first_read(package: Path) -> None:
    (package / "gear.py").write_text(WIDGET.format(package="registry_test_pkg", name="gear", label="Gear"))
    (package / "sub" / "cog.py").write_text(WIDGET.format(package="registry_test_pkg", name="cog", label=""))
    import registry_test_pkg

    assert "registry_test_pkg.gear" not in sys.modules  # nothing imported it: the registry finds it
    assert registry_test_pkg.WIDGETS.names() == ["cog", "gear"]
    assert [registry_test_pkg.WIDGETS.label(n) for n in ("cog", "gear")] == ["cog", "Gear"]
    with pytest.raises(ValueError, match="unknown widget 'bolt'; choose one of cog, gear"):
        registry_test_pkg.WIDGETS.get("bolt")


def test_a_broken_module_is_an_error_on_every_read_not_a_shorter_list(package: Path) -> None:
    (package / "gear.py").write_text(WIDGET.format(package="registry_test_pkg", name="gear", label=""))
    (package / "broken.py").write_text("raise RuntimeError('broken on purpose')\n")
    import registry_test_pkg

    for _ in range(2):
        with pytest.raises(RuntimeError, match="broken on purpose"):
            registry_test_pkg.WIDGETS.names()


def test_a_score_module_dropped_on_the_scores_path_is_found(tmp_path: Path) -> None:
    """In a fresh interpreter, as a user would: a module on the path of ``kvbench.policies.scores`` that nothing
    imports is a score as soon as the scores are read."""
    (tmp_path / "registry_test_dropped.py").write_text(
        textwrap.dedent("""
            from kvbench.policies.base import Score
            from kvbench.policies.parts import register_score


            @register_score("registry_test_dropped")
            class Dropped(Score):
                label = "Dropped"

                def __call__(self, state):
                    return state.positions.float()
        """)
    )
    script = (
        "import kvbench.policies.scores as s, sys; s.__path__.append(sys.argv[1]); "
        "from kvbench.policies.parts import SCORES; print(SCORES.names(), SCORES.label('registry_test_dropped'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": ""},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "'registry_test_dropped'" in out and "'accumulated'" in out and out.strip().endswith("Dropped")
