"""The part registries: each built-in module registers its part, names are taken once, bad input is refused."""

from __future__ import annotations

import pkgutil

import pytest
import torch

import kvbench.policies.allocations as allocations
import kvbench.policies.scopes as scopes
import kvbench.policies.scores as scores
from kvbench.policies.base import Score
from kvbench.policies.parts import ALLOCATIONS, SCOPES, SCORES, register_score
from kvbench.policies.registry import build_policy
from kvbench.policies.scores.accumulated import Accumulated
from kvbench.policies.state import TokenState


@pytest.mark.parametrize("package, registry", [(scores, SCORES), (scopes, SCOPES), (allocations, ALLOCATIONS)])
def test_every_module_of_a_part_folder_registers_what_it_defines(package, registry) -> None:
    """Each registered class lives in its own module of the folder, and every module but the ``shared``
    wrapper defines a registered part (a module dropped in the folder is found without being listed)."""
    modules = {m.name for m in pkgutil.iter_modules(package.__path__)} - {"shared"}
    homes = [
        module.removeprefix(package.__name__ + ".")
        for module in (registry.get(name).__module__ for name in registry.names())
        if module.startswith(package.__name__ + ".")  # not the parts other tests register
    ]
    assert modules <= set(homes)
    assert len(set(homes)) == len(homes), "one part per module"


def test_a_name_is_taken_once_and_only_by_a_part_of_its_kind() -> None:
    class Other(Score):
        def __call__(self, state: TokenState) -> torch.Tensor:
            return state.positions.float()

    with pytest.raises(ValueError, match="score 'accumulated' is already .*Accumulated"):
        register_score("accumulated")(Other)
    assert register_score("accumulated")(Accumulated) is Accumulated  # its own module imported again: fine
    with pytest.raises(TypeError, match="not a subclass of Score"):
        register_score("not_a_score")(dict)
    assert "not_a_score" not in SCORES


def test_unknown_kinds_and_statistics_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown score 'acumulated'; choose one of .*accumulated, .*hits"):
        build_policy({"name": "p", "score": "acumulated"})
    with pytest.raises(ValueError, match=r"unknown allocation 'pyramids'"):
        build_policy({"name": "p", "score": "accumulated", "allocation": "pyramids"})

    @register_score("registry_test_typo")
    class Typo(Score):
        needs = frozenset({"acm"})

        def __call__(self, state: TokenState) -> torch.Tensor:
            return state.stats["acm"]

    with pytest.raises(ValueError, match="needs unknown statistic.* acm"):
        build_policy({"name": "p", "score": "registry_test_typo"})
