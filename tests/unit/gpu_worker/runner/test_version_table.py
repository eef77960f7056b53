"""VersionTable (gpu_worker/runner/version_table.py): the label rules both runners share."""

from __future__ import annotations

import pytest

from gpu_worker.runner.version_table import VersionTable


def test_a_table_reads_as_a_mapping_in_load_order_with_one_default() -> None:
    table = VersionTable("v1", "/a")
    table.add("v2", "/b")
    assert dict(table) == {"v1": "/a", "v2": "/b"} and list(table) == ["v1", "v2"]
    assert (table.default_version, table.default) == ("v1", "/a")
    assert "v2" in table and "v3" not in table and table.get("v3") is None
    with pytest.raises(ValueError, match="'v2' is already loaded"):
        table.add("v2", "/c")


def test_the_default_moves_only_to_a_loaded_label() -> None:
    table = VersionTable("v1", "/a")
    with pytest.raises(KeyError):
        table.set_default("v2")
    table.add("v2", "/b")
    table.set_default("v2")
    assert (table.default_version, table.default) == ("v2", "/b")


def test_relabel_renames_in_place_of_load_order_and_the_default_follows() -> None:
    table = VersionTable("v1", "/a")
    table.add("v2", "/b")
    table.relabel("v1", "v1")  # the same label: nothing to do
    table.relabel("v1", "ops")
    assert dict(table) == {"v2": "/b", "ops": "/a"} and table.default_version == "ops"
    table.relabel("v2", "old")  # not the default: the default stays
    assert table.default_version == "ops"
    with pytest.raises(ValueError, match="already loaded"):
        table.relabel("ops", "old")
    assert dict(table) == {"ops": "/a", "old": "/b"}


def test_only_a_version_other_than_the_default_is_removed() -> None:
    table = VersionTable("v1", "/a")
    table.add("v2", "/b")
    with pytest.raises(ValueError, match="is the default; switch first"):
        table.remove("v1")
    table.remove("v2")
    assert list(table) == ["v1"]
    with pytest.raises(KeyError):
        table.remove("v2")
