"""The model versions a runner holds, by label, and which one is the default.

Every runner keeps one (gpu_worker/runner/base.py's `PlanRunner`): the real runner's
entries are loaded weights (gpu_worker/runner/versions.py), the synthetic runner's the folder it
imitates. New requests without an explicit version run on the default one; a request keeps its
version for life, so a version other than the default leaves only once no request uses it. This
module imports no torch (the synthetic runner never does).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TypeVar

VersionT = TypeVar("VersionT")


class VersionTable(Mapping[str, VersionT]):
    """Loaded versions by label (in load order) and the default label; read as a mapping."""

    def __init__(self, label: str, first: VersionT) -> None:
        self._versions = {label: first}
        self._default = label

    def __getitem__(self, label: str) -> VersionT:
        return self._versions[label]

    def __iter__(self) -> Iterator[str]:
        return iter(self._versions)

    def __len__(self) -> int:
        return len(self._versions)

    @property
    def default_version(self) -> str:
        """The label new requests without an explicit version run on."""
        return self._default

    @property
    def default(self) -> VersionT:
        return self._versions[self._default]

    def add(self, label: str, version: VersionT) -> None:
        if label in self._versions:
            raise ValueError(f"model version {label!r} is already loaded")
        self._versions[label] = version

    def set_default(self, label: str) -> None:
        """New requests without an explicit version run on `label` from now on."""
        if label not in self._versions:
            raise KeyError(label)
        self._default = label

    def relabel(self, old: str, new: str) -> None:
        """Rename a version (the default label follows it)."""
        if new == old:
            return
        self.add(new, self._versions[old])
        del self._versions[old]
        if self._default == old:
            self._default = new

    def remove(self, label: str) -> None:
        """Forget a version other than the default (its users are the caller's to check)."""
        if label == self._default:
            raise ValueError(f"version {label!r} is the default; switch first")
        del self._versions[label]
