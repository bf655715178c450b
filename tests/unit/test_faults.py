"""Fault injection is a test hook: `tandem worker --fault` and `tandem serve --prefill-fault` are refused unless
the environment says TANDEM_ENABLE_FAULTS=1 (the operator side, which never lets a resource pass either, is in
tests/operator/invalid_resources.yaml)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tandem.worker import faults
from tandem.worker.cli import main
from tandem.worker.server import control_token
from tandem.worker.server.config import WorkerConfig
from tandem.worker.server.supervisor import StackSpec


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    return tmp_path


@pytest.mark.parametrize("value", [None, "", "0", "true", "yes", " 1"])
def test_the_switch_is_exactly_one(value: str | None) -> None:
    assert not faults.enabled({} if value is None else {faults.ENV: value})
    assert faults.enabled({faults.ENV: "1"})


def test_a_worker_refuses_a_fault_without_the_switch(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.ENV, raising=False)
    with pytest.raises(ValueError, match=f"--fault is a test hook .* unless the environment sets {faults.ENV}=1"):
        WorkerConfig(model_dir=model_dir, role="prefill", fault="drop-kv")
    WorkerConfig(model_dir=model_dir, role="prefill")  # no fault: nothing to switch on
    monkeypatch.setenv(faults.ENV, "1")
    assert WorkerConfig(model_dir=model_dir, role="prefill", fault="drop-kv").fault == "drop-kv"
    with pytest.raises(ValueError, match="unknown fault"):
        WorkerConfig(model_dir=model_dir, role="prefill", fault="explode")


def test_tandem_worker_fault_is_a_usage_error_without_the_switch(model_dir: Path) -> None:
    args = ["worker", "--role", "prefill", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
            "--insecure-control-api", "--fault", "drop-kv"]
    no_token = {control_token.ENV_TOKEN: None, control_token.ENV_TOKEN_FILE: None}
    result = CliRunner().invoke(main, args, env={faults.ENV: None, **no_token})
    assert result.exit_code == 2, result.output
    assert "--fault is a test hook" in result.output and f"{faults.ENV}=1" in result.output


def test_a_local_stack_refuses_a_prefill_fault_without_the_switch(model_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.ENV, raising=False)
    with pytest.raises(ValueError, match=f"--prefill-fault is a test hook .*{faults.ENV}=1"):
        StackSpec(model_dir=model_dir, model_name="tiny", prefill_fault="drop-kv")
    StackSpec(model_dir=model_dir, model_name="tiny")
    monkeypatch.setenv(faults.ENV, "1")  # the workers `tandem serve` starts inherit it
    assert StackSpec(model_dir=model_dir, model_name="tiny", prefill_fault="drop-kv").prefill_fault == "drop-kv"


def test_the_hidden_options_take_the_known_faults() -> None:
    from tandem.worker.commands import serve, worker

    assert "drop-kv" in faults.FAULTS and faults.FLAG == "--fault"
    choices = {p.name: getattr(p.type, "choices", None) for cmd in (worker.command, serve.command) for p in cmd.params}
    assert tuple(choices["fault"]) == tuple(choices["prefill_fault"]) == faults.FAULTS
