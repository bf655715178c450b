"""The OpenAI request fields applications send, through the official `openai` client against real
`tandem serve` stacks: what is implemented works in both modes, and what is not is refused with a
400 naming the field instead of being dropped (issue 20)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from .conftest import Stack

pytestmark = pytest.mark.integration

MESSAGES: list[Any] = [{"role": "user", "content": "Say something."}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize(("kw", "param"), [
    ({"extra_body": {"functions": [TOOL["function"]]}}, "functions"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= 'a'"}}}, "structured_outputs.grammar"),
], ids=["deprecated-functions", "ebnf-grammar"])
def test_unimplemented_chat_fields_are_refused_naming_the_field(mono: Stack, kw: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(mono).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **kw)
    body: Any = info.value.body
    assert body["param"] == param and param in body["message"]


def test_fields_that_mean_nothing_here_are_accepted(disagg: Stack) -> None:
    resp = client(disagg).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, user="u",
                                                  metadata={"k": "v"}, store=False, response_format={"type": "text"})
    assert resp.choices[0].finish_reason in ("length", "stop")


@pytest.fixture(scope="module")
def hf_model(tiny_model: Path) -> Any:
    """The test model in transformers: the reference."""
    transformers = pytest.importorskip("transformers", reason="transformers is the reference (test extra)")
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def hf_logprobs(hf_model: Any) -> Callable[[list[int]], Any]:
    """transformers' log-softmax at every position of a token sequence: the reference for logprobs."""
    import torch

    model = hf_model

    def logprobs(ids: list[int]) -> Any:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def _by_text(tokenizer: Any, ids: list[int], lps: list[float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for i, lp in zip(ids, lps, strict=True):
        out.setdefault(tokenizer.decode([i], skip_special_tokens=False), lp)
    return out


@pytest.mark.parametrize("mode", ["disagg", "mono", "chunked"])
def test_completion_top_logprobs_equal_transformers(mode: str, request: pytest.FixtureRequest, tokenizer: Any,
                                                    hf_logprobs: Callable[[list[int]], Any]) -> None:
    import torch

    stack: Stack = request.getfixturevalue(mode)
    prompt = "The quick brown fox jumps over the lazy dog."
    choice = client(stack).completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                              extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    prompt_ids = tokenizer.encode(prompt)
    out_ids = choice.model_extra["token_ids"]
    ref = hf_logprobs(prompt_ids + out_ids)[len(prompt_ids) - 1:-1]  # the distribution each output token came from
    assert choice.logprobs.token_logprobs == pytest.approx([ref[i, t].item() for i, t in enumerate(out_ids)], abs=1e-4)
    assert len(choice.logprobs.top_logprobs) == len(out_ids)  # the first token's came from the prefill worker
    for got, row in zip(choice.logprobs.top_logprobs, ref, strict=True):
        best = torch.topk(row, 3)
        expected = _by_text(tokenizer, best.indices.tolist(), best.values.tolist())
        assert got.keys() == expected.keys()
        assert list(got.values()) == pytest.approx(list(expected.values()), abs=1e-4)


@pytest.mark.parametrize("mode", ["disagg", "mono", "chunked"])
def test_chat_top_logprobs_streamed_equal_whole(mode: str, request: pytest.FixtureRequest) -> None:
    stack: Stack = request.getfixturevalue(mode)
    kw: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "logprobs": True,
                          "top_logprobs": 4, "extra_body": {"ignore_eos": True}}
    whole = client(stack).chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [c for chunk in client(stack).chat.completions.create(stream=True, **kw) for choice in chunk.choices
                if choice.logprobs for c in choice.logprobs.content or []]
    assert len(whole) == 5 and [len(c.top_logprobs) for c in whole] == [4] * 5
    def tokens(entries: list[Any]) -> list[Any]:
        return [(c.token, [t.token for t in c.top_logprobs]) for c in entries]

    def logprobs(entries: list[Any]) -> list[float]:
        return [lp for c in entries for lp in (c.logprob, *(t.logprob for t in c.top_logprobs))]

    assert tokens(streamed) == tokens(whole)
    assert logprobs(streamed) == pytest.approx(logprobs(whole), abs=1e-4)  # two runs: float noise only
    for c in whole:  # the chosen token is the best one (greedy), and the list is best first
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)


def test_top_logprobs_without_logprobs_is_refused(mono: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(mono).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, top_logprobs=3)
    assert info.value.body["param"] == "top_logprobs"  # type: ignore[index]


class _OpenAIPenalties:
    """OpenAI's presence/frequency penalties as a transformers logits processor, written from OpenAI's
    definition (generated tokens only), to drive transformers' greedy search as the reference."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        counts = torch.bincount(input_ids[0, self.prompt_len:], minlength=scores.shape[-1]).to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def _hf_greedy(model: Any, prompt: list[int], n: int, **kw: Any) -> list[int]:
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])  # the mask explicit: pad_token_id 0 is also the tiny model's BOS
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
    return list(out[0, len(prompt):].tolist())


PENALTY_PROMPT = "A paged KV cache stores keys and values in blocks."


@pytest.mark.parametrize("mode", ["disagg", "mono", "chunked"])
@pytest.mark.parametrize("setting", ["repetition", "presence-frequency"])
def test_penalties_change_the_output_as_transformers(mode: str, setting: str, request: pytest.FixtureRequest,
                                                     tokenizer: Any, hf_model: Any) -> None:
    import transformers

    stack: Stack = request.getfixturevalue(mode)
    prompt = tokenizer.encode(PENALTY_PROMPT)
    n = 24  # the random model's greedy output first repeats a token after 12
    if setting == "repetition":
        body: dict[str, Any] = {"repetition_penalty": 2.0}
        expected = _hf_greedy(hf_model, prompt, n, repetition_penalty=2.0)
    else:
        body = {"presence_penalty": 1.5, "frequency_penalty": 0.7}
        processors = transformers.LogitsProcessorList([_OpenAIPenalties(len(prompt), 1.5, 0.7)])
        expected = _hf_greedy(hf_model, prompt, n, logits_processor=processors)
    assert expected != _hf_greedy(hf_model, prompt, n), "the setting does not change transformers' output here"
    choice = client(stack).completions.create(model="tiny", prompt=PENALTY_PROMPT, max_tokens=n, temperature=0,
                                              extra_body={"ignore_eos": True, "return_token_ids": True, **body}).choices[0]
    assert choice.model_extra["token_ids"] == expected


@pytest.mark.parametrize("mode", ["disagg", "mono", "chunked"])
def test_logit_bias_forces_and_bans_tokens(mode: str, request: pytest.FixtureRequest, tokenizer: Any,
                                           hf_model: Any) -> None:
    stack: Stack = request.getfixturevalue(mode)
    plain = _hf_greedy(hf_model, tokenizer.encode(PENALTY_PROMPT), 6)
    kw: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": PENALTY_PROMPT}], "max_tokens": 6,
                          "temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    forced = client(stack).chat.completions.create(logit_bias={"7": 100}, **kw).choices[0]
    assert forced.model_extra["token_ids"] == [7] * 6
    free = client(stack).chat.completions.create(**kw).choices[0].model_extra["token_ids"]
    banned = client(stack).chat.completions.create(logit_bias={str(t): -100 for t in set(free)}, **kw).choices[0]
    assert not set(banned.model_extra["token_ids"]) & set(free)
    assert plain  # the reference model loaded


def test_bad_penalties_are_400s(mono: Stack) -> None:
    for kw, param in (({"presence_penalty": 3}, "presence_penalty"), ({"logit_bias": {"999999": 5}}, "logit_bias")):
        with pytest.raises(openai.BadRequestError) as info:
            client(mono).completions.create(model="tiny", prompt="x", max_tokens=2, **kw)
        assert info.value.body["param"] == param, info.value.body  # type: ignore[index]


def test_tokenize_detokenize_and_version(disagg: Stack, tokenizer: Any) -> None:
    import httpx

    text = "Zürich, café; 東京 🙂"
    tok = httpx.post(f"{disagg.url}/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True},
                     timeout=30).json()
    assert tok["tokens"] == tokenizer.encode(text) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] > 0 and len(tok["token_strs"]) == tok["count"]
    back = httpx.post(f"{disagg.url}/detokenize", json={"model": "tiny", "tokens": tok["tokens"]}, timeout=30).json()
    assert back["prompt"] == tokenizer.decode(tok["tokens"], skip_special_tokens=False)
    # A chat prompt's count is what the chat completion is charged.
    chat = httpx.post(f"{disagg.url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()
    usage = client(disagg).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1).usage
    assert usage is not None and chat["count"] == usage.prompt_tokens
    assert httpx.get(f"{disagg.url}/version", timeout=30).json()["version"]


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"), ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/tokenize", {"prompt": "x", "add_bos": True}, 400, "add_bos"), ("/tokenize", {"model": "gpt", "prompt": "x"}, 404,
                                                                     "model"),
    ("/tokenize", {"messages": []}, 400, "messages"),
])
def test_tokenizer_endpoints_refuse_bad_input(mono: Stack, path: str, body: dict[str, Any], status: int,
                                              param: str) -> None:
    import httpx

    resp = httpx.post(f"{mono.url}{path}", json=body, timeout=30)
    assert resp.status_code == status and resp.json()["error"]["param"] == param, resp.text


@pytest.mark.parametrize("mode", ["disagg", "mono", "chunked"])
def test_n_choices(mode: str, request: pytest.FixtureRequest) -> None:
    stack: Stack = request.getfixturevalue(mode)
    kw: dict[str, Any] = {"model": "tiny", "prompt": PENALTY_PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 7,
                          "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    first = client(stack).completions.create(n=3, **kw)
    ids = [c.model_extra["token_ids"] for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and all(len(i) == 8 for i in ids)
    assert len({tuple(i) for i in ids}) == 3  # seed, seed + 1, seed + 2
    assert first.usage is not None and first.usage.completion_tokens == 24
    again = client(stack).completions.create(n=3, **kw)
    assert [c.model_extra["token_ids"] for c in again.choices] == ids  # seeded: the same choices again
    single = client(stack).completions.create(n=1, **kw).choices[0]
    assert single.model_extra["token_ids"] == ids[0]  # choice 0 is the request's own seed
    chat = client(stack).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, n=2, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


@pytest.mark.parametrize("mode", ["disagg", "mono", "chunked"])
def test_n_choices_streamed_equal_whole(mode: str, request: pytest.FixtureRequest) -> None:
    stack: Stack = request.getfixturevalue(mode)
    kw: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 1.0, "seed": 11,
                          "n": 3, "extra_body": {"ignore_eos": True}}
    whole = client(stack).chat.completions.create(**kw)
    texts, usage, finish = ["", "", ""], None, {}
    for chunk in client(stack).chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in whole.choices] and len(set(texts)) == 3
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 18 and usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore[union-attr]


def test_n_limits(mono: Stack) -> None:
    for kw in ({"n": 17}, {"n": 0}):
        with pytest.raises(openai.BadRequestError) as info:
            client(mono).completions.create(model="tiny", prompt="x", max_tokens=2, **kw)
        assert info.value.body["param"] == "n"  # type: ignore[index]


@pytest.mark.parametrize("mode", ["disagg", "mono", "chunked"])
def test_min_tokens_holds_off_eos(mode: str, request: pytest.FixtureRequest, tokenizer: Any) -> None:
    stack: Stack = request.getfixturevalue(mode)
    eos = min(tokenizer.eos_token_ids)
    kw: dict[str, Any] = {"model": "tiny", "prompt": PENALTY_PROMPT, "max_tokens": 10, "temperature": 0,
                          "logit_bias": {str(eos): 100}}
    assert client(stack).completions.create(**kw).usage.completion_tokens == 1  # type: ignore[union-attr]
    held = client(stack).completions.create(extra_body={"min_tokens": 4, "return_token_ids": True}, **kw).choices[0]
    ids = held.model_extra["token_ids"]
    assert eos not in ids[:4] and held.finish_reason == "stop" and len(ids) == 5 and ids[4] == eos
    with pytest.raises(openai.BadRequestError) as info:
        client(stack).completions.create(extra_body={"min_tokens": 11}, **kw)
    assert info.value.body["param"] == "min_tokens"  # type: ignore[index]


def test_a_client_that_leaves_a_streamed_n_request_frees_every_choice(disagg: Stack) -> None:
    import time

    import httpx

    from .conftest import control_headers

    body = {"model": "tiny", "prompt": PENALTY_PROMPT, "max_tokens": 400, "n": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{disagg.url}/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        assert [next(lines) for _ in range(6)]  # the choices are under way
    workers = [p["url"] for p in disagg.state["processes"] if p["role"] in ("prefill", "decode")]
    limit = time.monotonic() + 15
    while True:
        infos = [httpx.get(f"{url}/info", headers=control_headers(), timeout=5).json() for url in workers]
        if all(i["in_flight"] == 0 and i["stats"]["num_running"] == 0 for i in infos):
            break
        assert time.monotonic() < limit, f"the workers still serve a gone client's choices: {infos}"
        time.sleep(0.05)
