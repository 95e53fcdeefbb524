"""Where policy parts are found by name: one registry per kind (score, scope, allocation).

A part registers itself where it is defined (``@register_score("name")`` on its class), so adding one is adding
one module: every module in ``kvbench/policies/scores/`` (``scopes/``, ``allocations/``) is imported the first time
a name is looked up. A part defined elsewhere (a notebook, a test, a plug-in) registers when its module is
imported, before the policy that names it is built.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from kvbench.policies.base import Allocation, Scope, Score

P = TypeVar("P")


class PartRegistry(Generic[P]):
    """Classes of one kind of part (subclasses of ``base``) by the name a policy config gives as ``kind``."""

    def __init__(self, what: str, base: type, package: str):
        self.what, self.base, self.package = what, base, package
        self._classes: dict[str, type[P]] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[type[P]], type[P]]:
        """Class decorator: the class becomes ``kind: name``. A name is taken once (re-importing its module is
        fine: the class keeps its name)."""

        def add(cls: type[P]) -> type[P]:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"{self.what} {name!r}: {cls!r} is not a subclass of {self.base.__name__}")
            held = self._classes.get(name)
            if held is not None and (held.__module__, held.__qualname__) != (cls.__module__, cls.__qualname__):
                raise ValueError(f"{self.what} {name!r} is already {held.__module__}.{held.__qualname__}")
            self._classes[name] = cls
            return cls

        return add

    def unregister(self, name: str) -> None:
        """Forget ``name`` (a part registered for a while, as a test's own, leaves the names as it found them)."""
        self._classes.pop(name, None)

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            importlib.import_module(self.package)

    def get(self, name: str) -> type[P]:
        self._load()
        if name not in self._classes:
            raise ValueError(f"unknown {self.what} {name!r}; choose one of {self.names()}")
        return self._classes[name]

    def names(self) -> list[str]:
        self._load()
        return sorted(self._classes)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._classes


def import_modules(package: str, path: Iterable[str]) -> None:
    """Import every module of a package (its parts register themselves as they are defined)."""
    for module in pkgutil.iter_modules(path):
        importlib.import_module(f"{package}.{module.name}")


SCORES: PartRegistry[Score] = PartRegistry("score", Score, "kvbench.policies.scores")
SCOPES: PartRegistry[Scope] = PartRegistry("scope", Scope, "kvbench.policies.scopes")
ALLOCATIONS: PartRegistry[Allocation] = PartRegistry("allocation", Allocation, "kvbench.policies.allocations")

register_score = SCORES.register
register_scope = SCOPES.register
register_allocation = ALLOCATIONS.register
