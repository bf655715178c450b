"""Puts this folder on sys.path so the tests can import chart_helpers (pytest runs with
--import-mode=importlib, which does not), and caches helm renders per module."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chart_helpers import Manifest, helm_template


@pytest.fixture(scope="module")
def render() -> Callable[..., list[Manifest]]:
    cache: dict[tuple[tuple[str, ...], bool], list[Manifest]] = {}

    def cached(*set_args: str, include_crds: bool = False) -> list[Manifest]:
        key = (set_args, include_crds)
        if key not in cache:
            cache[key] = helm_template(*set_args, include_crds=include_crds)
        return cache[key]

    return cached
