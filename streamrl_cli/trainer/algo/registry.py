"""One registry per kind of choice in the maths (advantage estimator, policy loss, off-policy
correction level, KL estimator): a name -> entry table that a module fills with a decorator, and a
lookup that refuses an unknown name with the valid ones (the recipe's checks list the same names)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries of one kind, by name, in the order they were registered."""

    def __init__(self, kind: str):
        self.kind = kind  # what an entry is, for errors ("policy loss")
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered already")
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator: ``@POLICY_LOSSES.register("clip")`` over the entry's function."""
        return lambda entry: self.add(name, entry)

    def remove(self, name: str) -> None:
        """Take `name` out again (a test that registered its own entry)."""
        del self._entries[name]

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {', '.join(self._entries)}")
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
