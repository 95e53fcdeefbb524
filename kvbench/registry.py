"""Things of one kind found by name: scores, scopes, allocations, quantisers, tasks, metrics.

Whatever a config or a row names registers itself where it is defined (``@SCORES.register("snapkv")`` on the
class), so adding one is adding one module: the first time a registry is read it imports every module of its
packages (walking subpackages too), and no list of modules or names is kept anywhere. A name is taken once: a
second registration under it is refused, naming where each comes from, unless it is the same thing again (its
module imported anew, an equal declaration). Lists of names (error messages, the profiler's scores, the report's
labels) are read from here, so they cannot miss a new part.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
C = TypeVar("C")


def place_of(item: Any) -> str | None:
    """Where a class or function is defined (``module.QualifiedName``); None for other values."""
    if isinstance(item, type) or (callable(item) and hasattr(item, "__qualname__")):
        return f"{item.__module__}.{item.__qualname__}"
    return None


def caller(depth: int = 1) -> str:
    """``module:line`` of the code ``depth`` frames above the caller of this function."""
    frame = sys._getframe(depth + 1)
    return f"{frame.f_globals.get('__name__', '?')}:{frame.f_lineno}"


class Registry(Generic[T]):
    """``what`` things (error messages say ``unknown {what} 'x'``) by name, found in ``packages`` (dotted names
    of packages or modules). With ``base``, only subclasses of it are accepted.

    A registered thing may declare a display label (a ``label`` attribute); ``label(name)`` falls back to the
    name."""

    def __init__(self, what: str, packages: tuple[str, ...], base: type | None = None):
        self.what, self.packages, self.base = what, packages, base
        self._items: dict[str, T] = {}
        self._places: dict[str, str] = {}
        self._loaded = False

    def add(self, name: str, item: T, place: str) -> T:
        """Register ``item`` under ``name``; ``place`` says where it comes from (for the refusal of a clash)."""
        if self.base is not None and not (isinstance(item, type) and issubclass(item, self.base)):
            raise TypeError(f"{self.what} {name!r}: {item!r} is not a subclass of {self.base.__name__}")
        held = self._places.get(name)
        if held is not None and held != place:
            if item == self._items[name]:
                return item  # the same declaration made twice
            raise ValueError(
                f"{self.what} {name!r} is already registered by {held}; {place} registers it again: rename one"
            )
        self._items[name], self._places[name] = item, place
        return item

    def register(self, name: str) -> Callable[[C], C]:
        """Decorator: register the decorated class (or function) under ``name``."""

        def add(item: C) -> C:
            self.add(name, item, place_of(item) or caller())  # type: ignore[arg-type]
            return item

        return add

    def unregister(self, name: str) -> None:
        """Forget ``name`` (a test's own part leaves the names as it found them)."""
        self._items.pop(name, None)
        self._places.pop(name, None)

    def get(self, name: str) -> T:
        self._load()
        if name not in self._items:
            raise ValueError(f"unknown {self.what} {name!r}; choose one of {self.choices()}")
        return self._items[name]

    def names(self) -> list[str]:
        self._load()
        return sorted(self._items)

    def choices(self) -> str:
        """The names as error messages list them."""
        return ", ".join(self.names())

    def items(self) -> list[tuple[str, T]]:
        return [(name, self._items[name]) for name in self.names()]

    def label(self, name: str) -> str:
        """The display name ``name``'s thing declares (its ``label``), else the name itself."""
        return str(getattr(self.get(name), "label", "") or name)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._items

    def _load(self) -> None:
        """Import every module of the packages once (each registers what it defines as it is imported)."""
        if self._loaded:
            return
        self._loaded = True  # a module read while importing sees the names registered so far
        try:
            for package in self.packages:
                root = importlib.import_module(package)
                for module in pkgutil.walk_packages(getattr(root, "__path__", []), prefix=f"{package}."):
                    importlib.import_module(module.name)
        except BaseException:
            self._loaded = False  # the next read raises the same error, not a silently partial list
            raise

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {self.packages!r})"
