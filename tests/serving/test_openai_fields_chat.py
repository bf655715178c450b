"""The request fields docs/serving.md calls supported, through the official `openai` client against real
`tandem serve` stacks, where test_openai_fields.py and test_openai_parity.py test them for completions
only or for acceptance only: their effect on chat, the samplers' limits (top_k 1, min_p near 1, top_p
near 0 are greedy), ignore_eos, chat logprobs against transformers, usage with n, batches of prompts,
the fields accepted and ignored, and the limits that are 400s."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import openai
import pytest
from openai import OpenAI

from .conftest import Stack

pytestmark = pytest.mark.integration

MODES = ["disagg", "mono", "chunked"]
MESSAGES: list[Any] = [{"role": "user", "content": "A paged KV cache stores keys and values in blocks."}]
PROMPT = "A paged KV cache stores keys and values in blocks."
IDS = {"ignore_eos": True, "return_token_ids": True}


def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(stack: Stack, **kw: Any) -> Any:
    """A chat completion of MESSAGES, greedy unless told, with ignore_eos and the token ids."""
    kw.setdefault("temperature", 0)
    kw["extra_body"] = {**IDS, **kw.get("extra_body", {})}
    return client(stack).chat.completions.create(model="tiny", messages=kw.pop("messages", MESSAGES), **kw)


def complete(stack: Stack, **kw: Any) -> Any:
    kw.setdefault("temperature", 0)
    kw["extra_body"] = {**IDS, **kw.get("extra_body", {})}
    return client(stack).completions.create(model="tiny", prompt=kw.pop("prompt", PROMPT), **kw)


def token_ids(choice: Any) -> list[int]:
    return list(choice.model_extra["token_ids"])


def chat_prompt_ids(stack: Stack, messages: list[Any] = MESSAGES) -> list[int]:
    """The chat prompt as the server renders it (its /tokenize with messages)."""
    resp = httpx.post(f"{stack.url}/tokenize", json={"model": "tiny", "messages": messages}, timeout=30)
    assert resp.status_code == 200, resp.text
    return list(resp.json()["tokens"])


def bad_request(call: Callable[[], Any]) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    body: Any = info.value.body
    return dict(body)


@pytest.fixture(params=MODES)
def stack(request: pytest.FixtureRequest) -> Stack:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def hf_model(tiny_model: Path) -> Any:
    transformers = pytest.importorskip("transformers", reason="transformers is the reference (test extra)")
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    model.eval()
    return model


def hf_greedy(model: Any, prompt: list[int], n: int, **kw: Any) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():  # an explicit mask: generate would mask out the chat prompt's BOS (id 0, the pad id)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
    return list(out[0, len(prompt):].tolist())


class OpenAIPenalties:
    """OpenAI's presence/frequency penalties (generated tokens only) as a transformers logits processor."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        counts = torch.bincount(input_ids[0, self.prompt_len:], minlength=scores.shape[-1]).to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


# --- 1. chat variants of the completions-only tests ---------------------------------------------------------


def test_chat_stop_string_is_cut_out_of_the_content(stack: Stack) -> None:
    full = chat(stack, max_tokens=20).choices[0].message.content
    at = next(k for k in range(3, len(full) - 3) if full.find(full[k:k + 3]) == k)  # first occurs at k
    stop = full[at:at + 3]
    choice = chat(stack, max_tokens=20, stop=[stop]).choices[0]
    assert choice.message.content == full[:at] and choice.finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client(stack).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=20, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == full[:at]


def test_chat_stop_token_ids_end_the_answer_at_the_token(stack: Stack, tokenizer: Any) -> None:
    free = token_ids(chat(stack, max_tokens=12).choices[0])
    # A token first generated at k, after text that ends in whole characters (the random model writes
    # stray UTF-8 bytes; an incomplete character at the end of an answer is left out, as vLLM does).
    at = next(k for k in range(2, len(free)) if free.index(free[k]) == k and not tokenizer.decode(free[:k]).endswith("\ufffd"))
    choice = chat(stack, max_tokens=12, extra_body={"stop_token_ids": [free[at]]}).choices[0]
    assert token_ids(choice) == free[:at + 1] and choice.finish_reason == "stop"
    assert choice.message.content == tokenizer.decode(free[:at])  # the stop token's text is left out, as vLLM


def test_chat_min_tokens_holds_off_eos(stack: Stack, tokenizer: Any) -> None:
    eos = min(tokenizer.eos_token_ids)
    kw: dict[str, Any] = {"max_tokens": 10, "logit_bias": {str(eos): 100}, "extra_body": {"ignore_eos": False}}
    early = chat(stack, **kw).choices[0]
    assert token_ids(early) == [eos] and early.finish_reason == "stop"
    held = chat(stack, **{**kw, "extra_body": {"ignore_eos": False, "min_tokens": 4}}).choices[0]
    ids = token_ids(held)
    assert eos not in ids[:4] and len(ids) == 5 and ids[4] == eos and held.finish_reason == "stop"


@pytest.mark.parametrize("setting", ["repetition", "presence-frequency"])
def test_chat_penalties_change_the_output_as_transformers(stack: Stack, setting: str, hf_model: Any) -> None:
    import transformers

    prompt = chat_prompt_ids(stack)
    n = 24
    if setting == "repetition":
        body: dict[str, Any] = {"repetition_penalty": 2.0}
        expected = hf_greedy(hf_model, prompt, n, repetition_penalty=2.0)
    else:
        body = {"presence_penalty": 1.5, "frequency_penalty": 0.7}
        expected = hf_greedy(hf_model, prompt, n, logits_processor=transformers.LogitsProcessorList(
            [OpenAIPenalties(len(prompt), 1.5, 0.7)]))
    assert expected != hf_greedy(hf_model, prompt, n), "the setting does not change transformers' output here"
    assert token_ids(chat(stack, max_tokens=n, extra_body=body).choices[0]) == expected


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 120}}}
REGEX = "[0-9]{3}-[a-z]{2}"


def _valid_json(text: str) -> bool:
    return jsonschema_rs.is_valid(SCHEMA, json.loads(text))


def _valid_regex(text: str) -> bool:
    return re.fullmatch(REGEX, text) is not None


GRAMMARS = [
    ({"guided_json": SCHEMA}, _valid_json), ({"guided_regex": REGEX}, _valid_regex),
    ({"guided_choice": ["alpha", "beta"]}, lambda text: text in ("alpha", "beta")),
    ({"structured_outputs": {"json": SCHEMA}}, _valid_json), ({"structured_outputs": {"regex": REGEX}}, _valid_regex),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda text: text in ("yes", "no")),
]
GRAMMAR_IDS = ["guided-json", "guided-regex", "guided-choice", "so-json", "so-regex", "so-choice"]


@pytest.mark.parametrize(("extra", "check"), GRAMMARS, ids=GRAMMAR_IDS)
def test_chat_follows_the_vllm_grammar_fields(stack: Stack, extra: dict[str, Any], check: Any) -> None:
    choice = client(stack).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, seed=3,
                                                   extra_body=extra).choices[0]
    assert choice.finish_reason == "stop" and check(choice.message.content), choice.message.content


@pytest.mark.parametrize(("extra", "check"), GRAMMARS[3:5], ids=GRAMMAR_IDS[3:5])
def test_completions_follow_structured_outputs_json_and_regex(stack: Stack, extra: dict[str, Any], check: Any) -> None:
    choice = client(stack).completions.create(model="tiny", prompt="Answer:", max_tokens=60, seed=3,
                                              extra_body=extra).choices[0]
    assert choice.finish_reason == "stop" and check(choice.text), choice.text


# --- 2. the samplers' effects ---------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", [{"top_k": 1}, {"min_p": 0.9999}, {"top_p": 1e-6}], ids=["top_k", "min_p", "top_p"])
def test_samplers_at_their_limit_are_greedy(stack: Stack, setting: dict[str, Any]) -> None:
    kw: dict[str, Any] = {"max_tokens": 8, "temperature": 1.0, "seed": 1234}
    kw.update({"top_p": setting["top_p"]} if "top_p" in setting else {"extra_body": setting})
    greedy = token_ids(complete(stack, max_tokens=8).choices[0])
    sampled = token_ids(complete(stack, **kw).choices[0])
    plain = token_ids(complete(stack, max_tokens=8, temperature=1.0, seed=1234).choices[0])
    assert sampled == greedy and plain != greedy  # the seed alone would not be greedy
    assert token_ids(chat(stack, **kw).choices[0]) == token_ids(chat(stack, max_tokens=8).choices[0])


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_ignore_eos_runs_past_eos(stack: Stack, endpoint: str, tokenizer: Any) -> None:
    eos = min(tokenizer.eos_token_ids)
    call = complete if endpoint == "completions" else chat
    kw: dict[str, Any] = {"max_tokens": 5, "logit_bias": {str(eos): 100}}
    stopped = call(stack, extra_body={"ignore_eos": False}, **kw)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    assert token_ids(stopped.choices[0]) == [eos]
    ran = call(stack, **kw)
    assert ran.choices[0].finish_reason == "length" and ran.usage.completion_tokens == 5
    assert token_ids(ran.choices[0]) == [eos] * 5


# --- 3. chat logprobs against transformers --------------------------------------------------------------------


def test_chat_logprobs_and_top_logprobs_equal_transformers(stack: Stack, tokenizer: Any, hf_model: Any) -> None:
    import torch

    prompt = chat_prompt_ids(stack)
    choice = chat(stack, max_tokens=6, logprobs=True, top_logprobs=3).choices[0]
    out = token_ids(choice)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt + out])).logits[0].float(), dim=-1)[len(prompt) - 1:-1]
    entries = choice.logprobs.content
    assert len(entries) == len(out) == 6
    assert [e.logprob for e in entries] == pytest.approx([ref[i, t].item() for i, t in enumerate(out)], abs=1e-4)
    for entry, token, row in zip(entries, out, ref, strict=True):
        assert entry.token == tokenizer.decode([token], skip_special_tokens=False)
        best = torch.topk(row, 3)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([i], skip_special_tokens=False)
                                                        for i in best.indices.tolist()]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)


# --- 4. logprobs limits ---------------------------------------------------------------------------------------


def test_logprobs_limits(mono: Stack) -> None:
    top = chat(mono, max_tokens=1, logprobs=True, top_logprobs=20).choices[0].logprobs.content
    assert [len(e.top_logprobs) for e in top] == [20]
    body = bad_request(lambda: chat(mono, max_tokens=1, logprobs=True, top_logprobs=21))
    assert body["param"] == "top_logprobs" and "top_logprobs" in body["message"], body
    assert len(complete(mono, max_tokens=1, logprobs=5).choices[0].logprobs.top_logprobs[0]) >= 1
    body = bad_request(lambda: complete(mono, max_tokens=1, logprobs=6))
    assert body["param"] == "logprobs" and "logprobs" in body["message"], body


# --- 5. usage with n ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_usage_counts_the_prompt_once(stack: Stack, endpoint: str) -> None:
    call = complete if endpoint == "completions" else chat
    kw: dict[str, Any] = {"max_tokens": 4, "temperature": 1.0, "seed": 5, "extra_body": {"ignore_eos": False}}
    single = call(stack, **kw)
    many = call(stack, n=3, **kw)
    assert len(many.choices) == 3
    assert many.usage.prompt_tokens == single.usage.prompt_tokens
    assert many.usage.completion_tokens == sum(len(token_ids(c)) for c in many.choices)
    assert many.usage.total_tokens == many.usage.prompt_tokens + many.usage.completion_tokens


# --- 6. batches of prompts on /v1/completions -----------------------------------------------------------------

BATCH = ["The quick brown fox", "Kubernetes runs pods on nodes and"]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 21}], ids=["greedy", "seeded"])
def test_a_batch_of_prompts_with_n(stack: Stack, sampling: dict[str, Any]) -> None:
    kw: dict[str, Any] = {"max_tokens": 5, **sampling}
    whole = complete(stack, prompt=BATCH, n=2, **kw)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    prompt_tokens = 0
    for p, prompt in enumerate(BATCH):
        for i in range(2):
            one_kw = {**kw, "seed": kw["seed"] + i} if "seed" in kw else kw  # choice i uses seed + i
            one = complete(stack, prompt=prompt, **one_kw)
            got = whole.choices[p * 2 + i]
            assert (token_ids(got), got.text) == (token_ids(one.choices[0]), one.choices[0].text), (p, i)
        prompt_tokens += one.usage.prompt_tokens
    assert whole.usage.prompt_tokens == prompt_tokens
    assert whole.usage.completion_tokens == 20
    texts, ids, usage = [""] * 4, [[] for _ in range(4)], None
    for chunk in client(stack).completions.create(model="tiny", prompt=BATCH, n=2, stream=True,
                                                  stream_options={"include_usage": True}, extra_body=IDS, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            ids[c.index] += c.model_extra.get("token_ids") or []
        usage = chunk.usage or usage
    assert texts == [c.text for c in whole.choices] and ids == [token_ids(c) for c in whole.choices]
    assert usage is not None and usage.prompt_tokens == prompt_tokens


def test_more_than_64_choices_in_a_batch_is_a_400(mono: Stack) -> None:
    body = bad_request(lambda: complete(mono, prompt=[f"p{i}" for i in range(5)], n=13, max_tokens=1))
    assert body["param"] == "prompt" and "64" in body["message"], body
    assert len(complete(mono, prompt=[f"p{i}" for i in range(4)], n=16, max_tokens=1).choices) == 64


# --- 7. fields accepted and ignored ---------------------------------------------------------------------------


def test_ignored_fields_change_nothing_on_completions(mono: Stack) -> None:
    plain = complete(mono, max_tokens=6).choices[0]
    ignored = complete(mono, max_tokens=6, user="u-1", extra_body={
        "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "parallel_tool_calls": False}).choices[0]
    assert token_ids(ignored) == token_ids(plain) and ignored.text == plain.text


def test_ignored_fields_change_nothing_on_chat(mono: Stack) -> None:
    plain = chat(mono, max_tokens=6).choices[0]
    ignored = chat(mono, max_tokens=6, user="u-1", metadata={"k": "v"}, store=True, service_tier="default",
                   parallel_tool_calls=False).choices[0]
    assert token_ids(ignored) == token_ids(plain) and ignored.message.content == plain.message.content


# --- 8. limits that are 400s ----------------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


def test_logit_bias_of_more_than_1024_tokens_is_a_400(mono: Stack) -> None:
    # The tiny model has 512 tokens: the whole vocabulary is accepted; 1025 entries are refused for their
    # number (the message names the limit), before any id is looked at.
    assert complete(mono, max_tokens=1, logit_bias={str(t): 0.5 for t in range(512)}).choices
    body = bad_request(lambda: complete(mono, max_tokens=1, logit_bias={str(t): 0.5 for t in range(1025)}))
    assert body["param"] == "logit_bias" and "1024" in body["message"], body


def test_tool_limits_are_400s(mono: Stack) -> None:
    many = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(129)]
    assert chat(mono, max_tokens=1, tools=many[:128], tool_choice="none").choices
    body = bad_request(lambda: chat(mono, max_tokens=1, tools=many))
    assert body["param"] == "tools" and "128" in body["message"], body
    body = bad_request(lambda: chat(mono, max_tokens=1, tools=[TOOL], n=2))
    assert body["param"] == "n", body
    body = bad_request(lambda: chat(mono, max_tokens=1, function_call="auto"))
    assert body["param"] == "function_call" and "function_call" in body["message"], body
