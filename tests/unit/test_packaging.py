"""Packaging: every source package is listed, and no top-level `operator` shadows the stdlib."""

from __future__ import annotations

import importlib
import operator as stdlib_operator
import subprocess
import sys
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


def test_operator_folder_cannot_shadow_the_stdlib_from_the_repo_root() -> None:
    """Run from the root, '' is first on sys.path: a regular package operator/ would win over the stdlib
    (guidellm's spawned children died of it). A folder without __init__.py loses to the stdlib module."""
    assert not (REPO / "operator" / "__init__.py").exists()
    no_site = subprocess.run([sys.executable, "-S", "-c", "import collections, operator; print(operator.__file__)"],
                             cwd=REPO, capture_output=True, text=True)
    assert no_site.returncode == 0, no_site.stderr
    assert not no_site.stdout.startswith(str(REPO))
    # A tool that uses multiprocessing (spawned children re-import the stdlib with the parent's sys.path).
    code = ("import multiprocessing as mp\n"
            "if __name__ == '__main__':\n"
            "    with mp.get_context('spawn').Pool(2) as pool: print(pool.map(abs, [-1, -2]))\n")
    (REPO / ".pytest_cache").mkdir(exist_ok=True)
    script = REPO / ".pytest_cache" / "mp_tool.py"
    script.write_text(code)
    tool = subprocess.run([sys.executable, "-c", f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert tool.returncode == 0 and tool.stdout.strip() == "[1, 2]", tool.stderr


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


def test_xgrammars_lower_bound_is_the_version_tested() -> None:
    """pyproject's lower bound for xgrammar is the version the lock installs (the one CI tests) and the one
    worker/engine/grammar.py says it was tested with: a lock that moves on moves all three together."""
    from tandem.worker.engine.grammar import TESTED_XGRAMMAR

    worker = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["worker"]
    [pin] = [d for d in worker if d.startswith("xgrammar")]
    [locked] = [line.split("==")[1].strip() for line in (REPO / "requirements-lock.txt").read_text().splitlines()
                if line.startswith("xgrammar==")]
    assert pin == f"xgrammar>={TESTED_XGRAMMAR}" and locked == TESTED_XGRAMMAR, (pin, locked, TESTED_XGRAMMAR)
