"""Fixtures for the Hub tests: a tiny model served by the Hub stand-in (hub_standin.py; there is no
Hugging Face Hub reachable here), and `tandem` commands run against it with HF_ENDPOINT.

This folder is put on sys.path so the tests can import hub_standin (pytest runs with
--import-mode=importlib, which does not).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hub_standin import HubStandIn, Repo, folder_repo

GOOD_TOKEN = "hf_granted_token_for_tests"   # known to the stand-in, granted the gated repo
OTHER_TOKEN = "hf_valid_token_without_access"  # known to the stand-in, not granted
# Files a real repository often carries beside the engine's: never downloaded.
EXTRA_FILES = {"README.md": b"# tiny\n", "pytorch_model.bin": b"\0" * 4096,
               "original/consolidated.safetensors": b"\0" * 4096, "onnx/model.onnx": b"\0" * 4096}


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tandem.worker.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("hub-src") / "tiny")


@pytest.fixture
def hub(tiny_folder: Path) -> Iterator[HubStandIn]:
    with HubStandIn() as standin:
        tiny = folder_repo(tiny_folder)
        tiny.files.update(EXTRA_FILES)
        tiny.refs["v1"] = tiny.sha
        standin.repos["org/tiny"] = tiny
        standin.repos["org/gated"] = folder_repo(tiny_folder, gated=True, granted_tokens={GOOD_TOKEN})
        standin.repos["org/bin-only"] = Repo(files={"config.json": (tiny_folder / "config.json").read_bytes(),
                                                    "pytorch_model.bin": b"\0" * 4096})
        standin.known_tokens.update({GOOD_TOKEN, OTHER_TOKEN})
        yield standin


def hub_env(endpoint: str, hf_home: Path, **extra: str) -> dict[str, str]:
    """The environment of a `tandem` command against `endpoint`: no HF_* from the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE", "TRANSFORMERS_"))}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


def fetch(model: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tandem.worker.cli", "fetch-model", "--model", model],
                          capture_output=True, text=True, env=env, timeout=timeout)
