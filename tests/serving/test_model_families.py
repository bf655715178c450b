"""Each new family through `tandem serve` disaggregated (prefill worker + decode worker + router, KV
over tcp), answering the official openai client with transformers' greedy tokens.

The models are tiny random configs written by transformers (save_pretrained), with the tiny
byte-level tokenizer beside them; Gemma's windows are 8 tokens, so the prompts run past them
on both workers (the prefill worker's local layers and the decode worker's).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tandem.worker.server.ports import free_port

from .conftest import KV_CACHE_BYTES, Stack, metric_value, wait_until_disaggregated

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
            initializer_range=0.15, tie_word_embeddings=False)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "gemma2": ("Gemma2Config", dict(sliding_window=8)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
}
PROMPTS = ["Hello",
           "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in blocks. "
           "Prefill computes the prompt; decode generates one token at a time."]
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=list(CONFIGS))
def family_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                 tiny_model: Path) -> Iterator[tuple[Stack, Any, Path]]:
    transformers = pytest.importorskip("transformers", reason="transformers writes the models and is the reference")
    import torch

    name = request.param
    class_name, extra = CONFIGS[name]
    folder = tmp_path_factory.mktemp("families") / f"tiny-{name}"
    torch.manual_seed(0)
    config = getattr(transformers, class_name)(**{**TINY, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json"):  # the tiny byte-level tokenizer and chat template
        shutil.copy(tiny_model / file, folder / file)
    stack = _serve(folder, tmp_path_factory.mktemp(f"stack-{name}"))
    try:
        yield stack, model, folder
    finally:
        _stop(stack)


def _serve(model: Path, work: Path) -> Stack:
    port, state_file, log = free_port(), work / "state.json", work / "serve.log"
    argv = [sys.executable, "-m", "tandem.worker.cli", "serve", "--model", str(model), "--model-name", "tiny",
            "--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1", "--transport", "tcp",
            "--port", str(port), "--kv-cache-bytes", str(KV_CACHE_BYTES), "--log-dir", str(work / "logs"),
            "--state-file", str(state_file)]
    with log.open("wb") as fh:
        popen = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    limit = time.monotonic() + 180
    while not state_file.exists():
        if popen.poll() is not None or time.monotonic() > limit:
            popen.kill()
            popen.wait(10)
            pytest.fail(f"tandem serve did not come up for {model.name}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return Stack(f"http://127.0.0.1:{port}", "tiny", json.loads(state_file.read_text()), popen, log)


def _stop(stack: Stack) -> None:
    """SIGTERM, as Ctrl-C would; the supervisor stops its workers (checked: none is left)."""
    stack.popen.send_signal(signal.SIGTERM)
    try:
        stack.popen.wait(60)
    except subprocess.TimeoutExpired:
        stack.stop()  # kills what is left
        pytest.fail("tandem serve did not stop on SIGTERM")


def test_disaggregated_answers_with_transformers_tokens(family_stack: tuple[Stack, Any, Path]) -> None:
    import torch

    from tandem.worker.model.tokenizer import Tokenizer

    stack, reference, folder = family_stack
    wait_until_disaggregated(stack)
    tokenizer = Tokenizer(folder)
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    for prompt in PROMPTS:
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
        choice = answer.choices[0]
        prompt_ids = tokenizer.encode(prompt)
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS,
                                          min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                          pad_token_id=0)[0, len(prompt_ids):].tolist()
        assert choice.model_extra["token_ids"] == expected, f"{len(prompt_ids)}-token prompt diverged"
        assert choice.finish_reason == "length" and answer.usage.completion_tokens == MAX_TOKENS
    [prefill], [decode] = stack.procs("prefill"), stack.procs("decode")
    # The KV went from the prefill worker to the decode worker; the decode worker computed no prompt itself.
    assert metric_value(prefill["url"], "tandem_kv_transfer_bytes_total", direction="send") > 0
    assert metric_value(decode["url"], "tandem_kv_transfer_bytes_total", direction="recv") > 0
    assert metric_value(decode["url"], "tandem_fallback_prefills_total") == 0


def test_serve_refuses_an_unsupported_architecture_naming_the_supported_ones(tiny_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-m", "tandem.worker.cli", "serve", "--model", str(folder),
                           "--port", str(free_port()), "--log-dir", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "unsupported model architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM" in output
    for name in ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        assert name in output
