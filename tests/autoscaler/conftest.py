"""hack/load_model.py is a script, not a package: load it by path for the tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

LOAD_MODEL = Path(__file__).resolve().parents[2] / "hack" / "load_model.py"


@pytest.fixture(scope="session")
def load_model() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tandem_hack_load_model", LOAD_MODEL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
