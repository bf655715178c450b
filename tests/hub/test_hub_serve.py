"""`tandem serve --model org/tiny` and `tandem worker --model org/tiny` with the model on the Hub
stand-in (hub_standin.py; there is no Hugging Face Hub here): a real disaggregated stack answers the
openai client with transformers' greedy tokens, under the repository id as its model name."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from hub_standin import HubStandIn
from openai import OpenAI

from tandem.worker.server.ports import free_port

from .conftest import hub_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _greedy(folder: Path, prompt: list[int], n: int) -> list[int]:
    transformers = pytest.importorskip("transformers", reason="transformers is the reference (test extra)")
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return list(out[0, len(prompt):].tolist())


def _stop(popen: subprocess.Popen[bytes]) -> None:
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(60)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(10)


def test_serve_a_hub_model_disaggregated(hub: HubStandIn, tiny_folder: Path, tmp_path: Path) -> None:
    port = free_port()
    state = tmp_path / "state.json"
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "tandem.worker.cli", "serve", "--model", "org/tiny", "--mode", "disaggregated",
            "--port", str(port), "--kv-cache-bytes", str(8 << 20), "--log-dir", str(tmp_path / "logs"),
            "--state-file", str(state)]
    with log.open("wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=hub_env(hub.url, tmp_path / "hf"))
    try:
        limit = time.monotonic() + 180
        while not state.exists():
            assert popen.poll() is None and time.monotonic() < limit, log.read_text()[-3000:]
            time.sleep(0.2)
        roles = sorted(p["role"] for p in json.loads(state.read_text())["processes"])
        assert roles == ["decode", "prefill", "router"]
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["org/tiny"]
        from tandem.worker.model.tokenizer import Tokenizer

        prompt = "The quick brown fox jumps over the lazy dog."
        reply = client.completions.create(model="org/tiny", prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
        assert reply.choices[0].model_extra["token_ids"] == _greedy(tiny_folder, Tokenizer(tiny_folder).encode(prompt), 8)
    finally:
        _stop(popen)
    text = log.read_text()
    assert f"Hub model org/tiny: downloading from {hub.url}" in text
    assert len(hub.gets("model.safetensors")) == 1  # one download for the whole stack, not one per worker


def test_worker_takes_a_hub_model_offline_from_the_cache(hub: HubStandIn, tmp_path: Path) -> None:
    """`tandem worker --model org/tiny` with HF_HUB_OFFLINE and a cache that a fetch filled (what a pod with a
    shared cache volume does): ready, serving the repository id, without a request to the Hub."""
    fetched = subprocess.run([sys.executable, "-m", "tandem.worker.cli", "fetch-model", "--model", "org/tiny"],
                             capture_output=True, text=True, env=hub_env(hub.url, tmp_path / "hf"), timeout=120)
    assert fetched.returncode == 0, fetched.stderr
    asked = len(hub.log)
    port = free_port()
    log = tmp_path / "worker.log"
    env = hub_env(hub.url, tmp_path / "hf", HF_HUB_OFFLINE="1")
    with log.open("wb") as out:
        popen = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "worker", "--model", "org/tiny",
                                  "--port", str(port), "--kv-port", str(free_port()), "--kv-cache-bytes",
                                  str(8 << 20)], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        limit = time.monotonic() + 120
        while True:
            assert popen.poll() is None and time.monotonic() < limit, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        from tandem.worker.server.control_token import ENV_TOKEN, HEADER

        info = httpx.get(f"http://127.0.0.1:{port}/info", headers={HEADER: env[ENV_TOKEN]}, timeout=5).json()
        assert info["model"] == "org/tiny"
    finally:
        _stop(popen)
    assert len(hub.log) == asked
    assert "from the cache" in log.read_text() and "HF_HUB_OFFLINE is set" in log.read_text()
