"""Packaging: every source package is listed, and no top-level `operator` shadows the stdlib."""

from __future__ import annotations

import importlib
import operator as stdlib_operator
import tomllib
from pathlib import Path

from click.testing import CliRunner

REPO = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for folder, name in (("worker", "tandem.worker"), ("operator", "tandem.operator")):
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_operator_name_is_the_stdlib() -> None:
    assert hasattr(stdlib_operator, "itemgetter")
    assert importlib.import_module("tandem.operator").__name__ == "tandem.operator"


def test_cli_lists_subcommands() -> None:
    from tandem.worker.cli import main

    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for name in ("serve", "worker", "router", "bench", "doctor", "operator"):
        assert name in result.output


def test_unbuilt_subcommand_says_so_and_fails(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from tandem.worker import cli

    monkeypatch.setitem(cli.SUBCOMMANDS, "future", ("tandem.worker.commands.not_there", "Later.", "issue 99"))
    result = CliRunner().invoke(cli.main, ["future", "--anything"])
    assert result.exit_code == 2
    assert "not available in this version yet (issue 99" in result.output
