"""`vllm serve` flags that Tandem does not support yet: refused by name, never silently ignored.

Flags whose meaning Tandem shares (`--served-model-name`, `--max-model-len`, `--gpu-memory-utilization`,
...) are real options of `tandem serve` and `tandem worker`; this module covers the rest, so a user
who pastes a vLLM command line learns at once which part of it Tandem cannot honour.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

# flag -> (takes a value, why Tandem refuses it)
UNSUPPORTED: dict[str, tuple[bool, str]] = {
    "--pipeline-parallel-size": (True, "pipeline parallelism is not supported"),
    "--data-parallel-size": (True, "scale a pool's replicas instead (--prefill-workers/--decode-workers)"),
    "--quantization": (True, "quantized weights are not supported yet"),
    "--kv-cache-dtype": (True, "the KV cache uses the model's dtype"),
    "--tokenizer": (True, "the tokenizer is read from the model folder"),
    "--revision": (True, "models are local folders (see `tandem fetch-model`)"),
    "--download-dir": (True, "models are local folders (see `tandem fetch-model`)"),
    "--load-format": (True, "weights are read from safetensors files only"),
    "--trust-remote-code": (False, "only Tandem's built-in architectures run; no code is loaded from a model"),
    "--enable-lora": (False, "LoRA adapters are not supported yet"),
    "--lora-modules": (True, "LoRA adapters are not supported yet"),
    "--speculative-config": (True, "speculative decoding is not supported yet"),
    "--swap-space": (True, "KV blocks are never swapped to host memory"),
    "--cpu-offload-gb": (True, "weights are never offloaded to host memory"),
    "--enable-auto-tool-choice": (False, "tool calls are not supported yet"),
    "--tool-call-parser": (True, "tool calls are not supported yet"),
    "--reasoning-parser": (True, "reasoning parsers are not supported yet"),
    "--ssl-keyfile": (True, "`tandem serve` serves plain HTTP on this machine; `tandem router --ssl-certfile "
                      "--ssl-keyfile` serves HTTPS"),
    "--ssl-certfile": (True, "`tandem serve` serves plain HTTP on this machine; `tandem router --ssl-certfile "
                       "--ssl-keyfile` serves HTTPS"),
}


def _refuse(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    if value is None or value is False:
        return
    flag = param.opts[0]
    raise click.UsageError(f"{flag} is a vLLM flag that Tandem does not support yet: {UNSUPPORTED[flag][1]}.",
                           ctx=ctx)


def refuse_unsupported_vllm_flags(func: F) -> F:
    """Add every flag of UNSUPPORTED as a hidden option that fails with its reason when used."""
    for flag, (takes_value, _why) in UNSUPPORTED.items():
        func = click.option(flag, is_flag=not takes_value, default=None if takes_value else False,
                            hidden=True, expose_value=False, callback=_refuse)(func)
    return func


EPILOG = ("vLLM spellings accepted: --served-model-name, --max-model-len, --gpu-memory-utilization, "
          "--max-num-seqs, --max-num-batched-tokens, --host, --port, --seed, --dtype half|float. "
          "vLLM flags Tandem refuses (with the reason): " + ", ".join(UNSUPPORTED) + ".")
