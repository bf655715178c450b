"""Prompt logprobs (SamplingParams.prompt_logprobs, what completions' `echo` with `logprobs` returns): the
log-softmax transformers gives at each prompt position, for the prompt token that follows, with the top-k
alternatives. Computed whole, in chunks (chunked prefill), after a prefix that is in the prefix cache
(such a request computes its whole prompt), on the prefill role (handed over with the first token), and
at tensor-parallel size 2 (logits from rank 0 only); the generated tokens stay what they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tandem.worker.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams

from .conftest import GREEDY, HFModel, random_prompts, run_requests

TOP = 3


def reference(hf: HFModel, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of the prompt."""
    with torch.no_grad():
        return torch.log_softmax(hf.model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check(out: RequestOutput, hf: HFModel, prompt: list[int], top: int = TOP) -> None:
    ref = reference(hf, prompt)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt) - 1
    want = [ref[i, t].item() for i, t in enumerate(prompt[1:])]  # position i scores prompt token i + 1
    assert out.prompt_logprobs == pytest.approx(want, abs=1e-4)
    if top == 0:
        assert out.prompt_top_logprobs is None
        return
    assert out.prompt_top_logprobs is not None and len(out.prompt_top_logprobs) == len(prompt) - 1
    for i, alternatives in enumerate(out.prompt_top_logprobs):
        best = torch.topk(ref[i], top)
        assert [t for t, _ in alternatives] == best.indices.tolist()
        assert [lp for _, lp in alternatives] == pytest.approx(best.values.tolist(), abs=1e-4)


def first_with_prompt_logprobs(outputs: list[RequestOutput]) -> RequestOutput:
    """The request's output that carries its prompt logprobs: the first token's, and only that one."""
    carrying = [o for o in outputs if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is outputs[0] and outputs[0].new_token_ids
    return carrying[0]


def params(**kw: Any) -> SamplingParams:
    return dataclasses.replace(GREEDY, max_tokens=4, **kw)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers(hf_model: Callable[..., HFModel], chunked: bool) -> None:
    hf = hf_model()
    # An 8-token budget splits the long prompts into chunks that share steps with the other requests'
    # decodes and chunks; without chunking each prompt is computed in one step.
    engine = hf.engine(enable_chunked_prefill=chunked, max_num_batched_tokens=8 if chunked else 2048,
                       enable_prefix_caching=False)
    prompts = random_prompts((37, 5, 21, 1))
    plain = run_requests(engine, {f"plain-{i}": (p, params()) for i, p in enumerate(prompts)})
    requests = {f"r{i}": (p, params(prompt_logprobs=TOP if i % 2 == 0 else 0)) for i, p in enumerate(prompts)}
    requests["none"] = (prompts[0], params())  # batched with them, wants none
    outs = run_requests(engine, requests)
    for i, prompt in enumerate(prompts):
        check(first_with_prompt_logprobs(outs[f"r{i}"]), hf, prompt, TOP if i % 2 == 0 else 0)
        # the generated tokens are the ones the request gets without prompt logprobs
        assert [t for o in outs[f"r{i}"] for t in o.new_token_ids] == [
            t for o in plain[f"plain-{i}"] for t in o.new_token_ids]
    assert all(o.prompt_logprobs is None for o in outs["none"])


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(hf_model: Callable[..., HFModel]) -> None:
    hf = hf_model()
    engine = hf.engine(enable_prefix_caching=True, block_size=16)
    prefix, = random_prompts((48,), seed=7)
    prompt = prefix + random_prompts((9,), seed=8)[0]
    run_requests(engine, {"warm": (prefix, params())})  # its 3 full blocks go into the prefix cache
    hits = engine.stats().prefix_cache_hits
    outs = run_requests(engine, {"echo": (prompt, params(prompt_logprobs=TOP))})
    check(first_with_prompt_logprobs(outs["echo"]), hf, prompt)
    assert outs["echo"][-1].num_cached_tokens == 0  # nothing read from the cache
    assert engine.stats().prefix_cache_hits == hits
    # ...which still serves the requests that want no prompt logprobs
    again = run_requests(engine, {"after": (prompt, params())})
    assert again["after"][-1].num_cached_tokens >= 48
    assert [t for o in again["after"] for t in o.new_token_ids] == [t for o in outs["echo"] for t in o.new_token_ids]


def test_the_prefill_role_hands_them_over_with_the_first_token(hf_model: Callable[..., HFModel]) -> None:
    hf = hf_model()
    engine = hf.engine(role="prefill", enable_chunked_prefill=True, max_num_batched_tokens=16)
    prompt, = random_prompts((40,), seed=3)
    outs = run_requests(engine, {"p": (prompt, params(prompt_logprobs=2))})
    assert [o.finish_reason for o in outs["p"]] == ["prefilled"]
    check(first_with_prompt_logprobs(outs["p"]), hf, prompt, 2)
    engine.release_kv("p")


def test_a_decode_handoff_computes_none(hf_model: Callable[..., HFModel]) -> None:
    """A decode worker receives the prompt's KV: it has no logits for the prompt and reports none."""
    hf = hf_model()
    engine = hf.engine(role="decode")
    prompt, = random_prompts((20,), seed=4)
    assert engine.reserve_kv("d", len(prompt)) is not None
    engine.add_prefilled_request("d", prompt, 5, params(prompt_logprobs=1))
    outs = list(engine.iter_outputs())
    assert outs and all(o.prompt_logprobs is None for o in outs)


def test_prompt_logprobs_out_of_range_are_refused() -> None:
    for bad in (-1, 21, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]


@contextlib.contextmanager
def _tp_engine(hf: HFModel, tp: int) -> Iterator[LLMEngine]:
    from tandem.worker.engine.tp_group import launch_engine

    engine = launch_engine(EngineConfig(model_dir=str(hf.path), kv_cache_bytes=1 << 22, max_num_batched_tokens=16,
                                        tensor_parallel_size=tp))
    try:
        yield engine
    finally:
        engine.close()


def test_tensor_parallel_rank_0_computes_them(hf_model: Callable[..., HFModel]) -> None:
    hf = hf_model()
    prompts = random_prompts((30, 12), seed=5)
    with _tp_engine(hf, 2) as engine:
        outs = run_requests(engine, {f"t{i}": (p, params(prompt_logprobs=TOP)) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        check(first_with_prompt_logprobs(outs[f"t{i}"]), hf, prompt)
        assert [t for o in outs[f"t{i}"] for t in o.new_token_ids] == hf.greedy(prompt, 4)
