"""vLLM's flag spellings: the shared ones are accepted, the rest refused by name with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from tandem.worker.commands import router as router_command
from tandem.worker.commands import serve as serve_command
from tandem.worker.commands import worker as worker_command
from tandem.worker.server.supervisor import LocalStack, StackSpec


@pytest.mark.parametrize("command", [serve_command.command, worker_command.command])
def test_help_shows_the_vllm_spellings(command) -> None:  # type: ignore[no-untyped-def]
    out = CliRunner().invoke(command, ["--help"], terminal_width=200).output
    for flag in ("--served-model-name", "--max-model-len", "--gpu-memory-utilization", "--max-num-seqs",
                 "--max-num-batched-tokens", "--host", "--port", "--seed", "--tensor-parallel-size"):
        assert flag in out, flag
    assert "--trust-remote-code" in out  # named in the epilog as refused


@pytest.mark.parametrize("command", [serve_command.command, worker_command.command])
@pytest.mark.parametrize(("args", "reason"), [
    (["--trust-remote-code"], "no code is loaded from a model"),
    (["--quantization", "awq"], "quantized weights are not supported yet"),
    (["--ssl-certfile", "c"], "`tandem router --ssl-certfile --ssl-keyfile` serves HTTPS"),
])
def test_unsupported_vllm_flags_are_refused_with_the_reason(command, args: list[str], reason: str,  # type: ignore[no-untyped-def]
                                                            tmp_path: Path) -> None:
    result = CliRunner().invoke(command, ["--model", str(tmp_path), *args])
    assert result.exit_code == 2
    assert f"{args[0]} is a vLLM flag that Tandem does not support yet" in result.output
    assert reason in result.output


def test_serve_refuses_tensor_parallelism_above_one() -> None:
    result = CliRunner().invoke(serve_command.command, ["--model", "tiny", "--tensor-parallel-size", "2"])
    assert result.exit_code == 2 and "--tensor-parallel-size" in result.output


def test_the_stack_passes_vllm_style_settings_to_its_processes(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    stack = LocalStack(StackSpec(model_dir=tmp_path, model_name="m", log_dir=tmp_path / "logs", memory_utilization=0.45,
                                 max_num_seqs=8, seed=7, chat_template=template))
    worker = stack.workers[0].argv
    params = worker_command.command.make_context("worker", worker[worker.index("worker") + 1:]).params
    assert (params["memory_utilization"], params["max_num_seqs"], params["seed"]) == (0.45, 8, 7)
    router = stack.router.argv
    params = router_command.command.make_context("router", router[router.index("router") + 1:]).params
    assert params["chat_template"] == template


def test_worker_accepts_served_model_name_as_model_name(tmp_path: Path) -> None:
    ctx = worker_command.command.make_context("worker", ["--model", str(tmp_path), "--served-model-name", "llama"])
    assert ctx.params["model_name"] == "llama"


def test_the_router_renders_chats_with_the_given_template(tmp_path: Path) -> None:
    import asyncio

    from tandem.worker.model.tiny import write_tiny_model
    from tandem.worker.router.app import RouterConfig, RouterState
    from tandem.worker.router.discovery import StaticDiscovery

    model = write_tiny_model(tmp_path / "tiny", family="llama")
    messages = [{"role": "user", "content": "Hi"}]
    cfg = RouterConfig(model_name="m", discovery=StaticDiscovery([]), model_dir=model)
    default = asyncio.run(RouterState(cfg).tokenizer()).apply_chat_template(messages)
    cfg.chat_template = "[{% for m in messages %}{{ m['role'] }}={{ m['content'] }}{% endfor %}]"
    custom = asyncio.run(RouterState(cfg).tokenizer()).apply_chat_template(messages)
    assert custom == "[user=Hi]" != default
