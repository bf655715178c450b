"""`echo` with `logprobs` on /v1/completions (issue 20): the prompt's own token logprobs, as
lm-evaluation-harness's `local-completions` loglikelihood asks for them, through the official `openai`
client against real `tandem serve` stacks (monolithic, chunked, disaggregated: there the prefill worker
computes them and they come back in its prefill answer). The reference is transformers' log-softmax over
the same tiny random model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from .conftest import Stack, metric_value, wait_until_disaggregated

pytestmark = pytest.mark.integration

PROMPT = "The quick brown fox jumps over the lazy dog. Paged KV caches keep keys and values in blocks."
MODES = ["mono", "chunked", "disagg"]


def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def stack_for(mode: str, request: pytest.FixtureRequest) -> Stack:
    stack: Stack = request.getfixturevalue(mode)
    if mode == "disagg":  # else the router sends everything to the decode worker until it sees both
        wait_until_disaggregated(stack)
    return stack


@pytest.fixture(scope="module")
def chunked(start_stack: Callable[..., Stack]) -> Stack:
    # 16 tokens a step: PROMPT's prompt logprobs are computed over several chunks
    return start_stack("--mode", "chunked", "--decode-workers", "1", "--max-num-batched-tokens", "16")


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model: Path) -> Iterator[Callable[[list[int]], Any]]:
    """transformers' log-softmax at every position of a token sequence."""
    transformers = pytest.importorskip("transformers", reason="transformers is the reference (test extra)")
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> Any:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    yield logprobs


def _by_text(tokenizer: Any, row: Any, k: int) -> dict[str, float]:
    import torch

    best = torch.topk(row, k)
    out: dict[str, float] = {}
    for i, lp in zip(best.indices.tolist(), best.values.tolist(), strict=True):
        out.setdefault(tokenizer.decode([i], skip_special_tokens=False), lp)
    return out


def check_prompt_part(logprobs: Any, prompt_ids: list[int], ref: Any, tokenizer: Any, k: int) -> None:
    """The first len(prompt_ids) entries: the prompt's tokens, the first without a logprob."""
    n = len(prompt_ids)
    assert logprobs.tokens[:n] == [tokenizer.decode([t], skip_special_tokens=False) for t in prompt_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    want = [ref[i, t].item() for i, t in enumerate(prompt_ids[1:])]  # position i scores token i + 1
    assert logprobs.token_logprobs[1:n] == pytest.approx(want, abs=1e-4)
    for i, got in enumerate(logprobs.top_logprobs[1:n]):
        expected = _by_text(tokenizer, ref[i], k)
        assert got.keys() == expected.keys()
        assert list(got.values()) == pytest.approx(list(expected.values()), abs=1e-4)
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and len(offsets) == len(logprobs.tokens)


@pytest.mark.parametrize("mode", MODES)
def test_echo_logprobs_equal_transformers(mode: str, request: pytest.FixtureRequest, tokenizer: Any,
                                          hf_logprobs: Callable[[list[int]], Any]) -> None:
    stack = stack_for(mode, request)
    kw: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2,
                          "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    plain = client(stack).completions.create(**kw)
    if mode == "disagg":
        prefill, decode = stack.procs("prefill")[0]["url"], stack.procs("decode")[0]["url"]
        before = [metric_value(prefill, "tandem_requests_total", reason="prefilled"),
                  metric_value(prefill, "tandem_prefix_cache_hits_total"),
                  metric_value(decode, "tandem_fallback_prefills_total")]
    echoed = client(stack).completions.create(echo=True, **kw)
    if mode == "disagg":  # the prefill worker computed the whole prompt (its cache holds it from `plain`)
        assert [metric_value(prefill, "tandem_requests_total", reason="prefilled"),
                metric_value(prefill, "tandem_prefix_cache_hits_total"),
                metric_value(decode, "tandem_fallback_prefills_total")] == [before[0] + 1, *before[1:]]
    p, e = plain.choices[0], echoed.choices[0]
    prompt_ids = tokenizer.encode(PROMPT)
    out_ids = e.model_extra["token_ids"]
    assert out_ids == p.model_extra["token_ids"] and len(out_ids) == 4
    assert e.text == PROMPT + p.text
    ref = hf_logprobs(prompt_ids + out_ids)
    check_prompt_part(e.logprobs, prompt_ids, ref, tokenizer, 2)
    n = len(prompt_ids)
    assert len(e.logprobs.tokens) == n + 4
    # the generated part is what the request without echo gets
    assert e.logprobs.tokens[n:] == p.logprobs.tokens
    assert e.logprobs.token_logprobs[n:] == pytest.approx(p.logprobs.token_logprobs, abs=1e-5)
    assert e.logprobs.token_logprobs[n:] == pytest.approx([ref[n - 1 + i, t].item() for i, t in enumerate(out_ids)],
                                                          abs=1e-4)
    assert [d.keys() for d in e.logprobs.top_logprobs[n:]] == [d.keys() for d in p.logprobs.top_logprobs]
    assert echoed.usage.prompt_tokens == n and echoed.usage.completion_tokens == 4
    # non-echo text_offset: where each generated token starts in the choice's text
    assert p.logprobs.text_offset[0] == 0


@pytest.mark.parametrize("mode", ["mono", "disagg"])
def test_lm_eval_loglikelihood_request(mode: str, request: pytest.FixtureRequest, tokenizer: Any,
                                       hf_logprobs: Callable[[list[int]], Any]) -> None:
    """What lm-eval's local-completions sends for loglikelihood (token ids, a batch of them, max_tokens 1,
    logprobs 1, echo) and how it reads the answer: sum(token_logprobs[ctxlen:-1]), and greedy when each
    of those tokens' logprob is its top_logprobs' best."""
    stack = stack_for(mode, request)
    context, continuation = tokenizer.encode("Question: what is a KV cache? Answer:"), tokenizer.encode(" blocks")
    other = tokenizer.encode("Hello there, general")
    batch = [context + continuation, other]
    body = {"model": "tiny", "prompt": batch, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    out = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).json()
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for choice, ids in zip(choices, batch, strict=True):
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids) + 1
        assert choice["text"].startswith(tokenizer.decode(ids, skip_special_tokens=False))
    ctxlen = len(context)
    lps = choices[0]["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choices[0]["logprobs"]["top_logprobs"][ctxlen:-1]
    ref = hf_logprobs(batch[0])
    want = [ref[i - 1, batch[0][i]].item() for i in range(ctxlen, len(batch[0]))]
    assert sum(lps) == pytest.approx(sum(want), abs=1e-3)
    greedy = all(lp == max(top.values()) for lp, top in zip(lps, tops, strict=True))
    assert greedy == all(ref[i - 1].argmax().item() == batch[0][i] for i in range(ctxlen, len(batch[0])))
    ref_other = hf_logprobs(other)
    assert choices[1]["logprobs"]["token_logprobs"][1:len(other)] == pytest.approx(
        [ref_other[i - 1, other[i]].item() for i in range(1, len(other))], abs=1e-4)
    assert out["usage"]["prompt_tokens"] == len(batch[0]) + len(other)


@pytest.mark.parametrize("mode", ["mono", "disagg"])
def test_echo_with_max_tokens_0_scores_the_prompt_alone(mode: str, request: pytest.FixtureRequest,
                                                        tokenizer: Any) -> None:
    stack = stack_for(mode, request)
    resp = client(stack).completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    choice = resp.choices[0]
    n = len(tokenizer.encode(PROMPT))
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == n and choice.logprobs.top_logprobs is None
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == n


@pytest.mark.parametrize("mode", ["mono", "disagg"])
def test_echo_streamed_equals_whole(mode: str, request: pytest.FixtureRequest) -> None:
    stack = stack_for(mode, request)
    kw: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 3,
                          "echo": True, "extra_body": {"ignore_eos": True}}
    whole = client(stack).completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client(stack).completions.create(stream=True, **kw) if c.choices]
    assert chunks[0].text.startswith(PROMPT)
    assert "".join(c.text for c in chunks) == whole.text
    parts = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for p in parts for t in p.tokens] == whole.logprobs.tokens
    assert [t for p in parts for t in p.text_offset] == whole.logprobs.text_offset
    streamed = [t for p in parts for t in p.token_logprobs]
    assert streamed[0] is None and whole.logprobs.token_logprobs[0] is None
    assert streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)


def test_echo_without_logprobs_and_with_token_ids(mono: Stack, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    plain = client(mono).completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    echoed = client(mono).completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].logprobs is None
    assert echoed.choices[0].text == tokenizer.decode(ids, skip_special_tokens=False) + plain.choices[0].text


def test_max_tokens_0_needs_echo(mono: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(mono).completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"  # type: ignore[index]


def test_only_echo_with_logprobs_asks_workers_of_control_api_5() -> None:
    from tandem.worker.router.openai_api import CompletionRequest, parse_body, sampling_from
    from tandem.worker.server.protocol import required_api_version

    def sampling(**body: Any) -> Any:
        req = parse_body(httpx.Request("POST", "/", json={"model": "m", "prompt": "x", **body}).read(),
                         CompletionRequest)
        return sampling_from(req, req.max_tokens if req.max_tokens is not None else 4, req.logprobs is not None,
                             req.logprobs or 0)

    assert sampling(echo=True, logprobs=2).prompt_logprobs == 2
    assert required_api_version(sampling(echo=True, logprobs=0)) == (5, ["prompt_logprobs"])
    assert sampling(echo=True, max_tokens=0).max_tokens == 1  # one token generated, left out of the answer
    for body in ({"echo": True}, {"logprobs": 3}, {}):
        assert sampling(**body).prompt_logprobs is None and required_api_version(sampling(**body))[0] < 5
