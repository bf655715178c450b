"""`tandem bench`: load-test an OpenAI-compatible endpoint and report TTFT, ITL, goodput."""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import click
import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tandem.worker.bench import client as bench_client
from tandem.worker.bench import workload
from tandem.worker.bench.report import overall_failure, print_summary, write_json
from tandem.worker.bench.stats import summarize

CALIBRATION_WORDS = 64


def _check_rate(rate: float | None) -> float | None:
    """--rate is requests per second, >= 0; 0 (or inf) sends every request at once."""
    if rate is not None and (math.isnan(rate) or rate < 0):
        raise click.BadParameter(f"{rate:g} is not a request rate: give requests per second (> 0), or 0 to "
                                 f"send every request at once", param_hint="'--rate'")
    return rate


@click.command("bench")
@click.option("--url", required=True, help="Base URL of the server, e.g. http://127.0.0.1:8000 (no /v1).")
@click.option("--model", default=None, help="Model name (default: the first one /v1/models lists).")
@click.option("--num-requests", "-n", type=click.IntRange(1, 100_000), default=50, show_default=True)
@click.option("--rate", type=float, default=None, callback=lambda _ctx, _param, value: _check_rate(value),
              help="Requests per second (0 = send every request at once; default 1). With --trace: the replay "
                   "rate (default: the trace's own pacing, times --time-scale; 0 = every row at once).")
@click.option("--arrival", type=click.Choice(["poisson", "constant"]), default="poisson", show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(1), default=128, show_default=True,
              help="Synthetic prompt length; with --trace, the median prompt after length scaling.")
@click.option("--output-tokens", type=click.IntRange(1), default=32, show_default=True)
@click.option("--trace", default=None,
              help=f"Replay a trace: {', '.join(workload.KNOWN_TRACES)} (from {workload.TRACES_DIR}) or a file.")
@click.option("--trace-offset", type=click.IntRange(0), default=0, help="First trace row to replay.")
@click.option("--time-scale", type=click.FloatRange(min=0), default=None,
              help="Multiply trace arrival times by this (default: reach --rate if given, else 1).")
@click.option("--length-scale", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Multiply trace token lengths by this (default: median prompt -> --prompt-tokens).")
@click.option("--max-prompt-tokens", type=click.IntRange(1), default=1024, show_default=True)
@click.option("--max-output-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--slo-ttft", type=float, default=None, help="TTFT SLO in seconds (for goodput).")
@click.option("--slo-itl", type=float, default=None, help="Mean inter-token latency SLO in seconds (for goodput).")
@click.option("--max-duration", type=float, default=300.0, show_default=True,
              help="Stop sending after this many seconds; unfinished requests count as failed.")
@click.option("--request-timeout", type=float, default=120.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--per-token", is_flag=True,
              help="Ask for one chunk per token (vLLM's return_token_ids; Tandem and vLLM honour it) so ITL is "
                   "per token; by default a token whose text is still empty arrives with the next chunk.")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None,
              help="Sent as Authorization: Bearer, for a router started with --api-key (env: OPENAI_API_KEY).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the results as JSON here.")
def command(url: str, model: str | None, num_requests: int, rate: float | None, arrival: str, prompt_tokens: int,
            output_tokens: int, trace: str | None, trace_offset: int, time_scale: float | None,
            length_scale: float | None, max_prompt_tokens: int, max_output_tokens: int,
            slo_ttft: float | None, slo_itl: float | None, max_duration: float, request_timeout: float,
            seed: int, per_token: bool, api_key: str | None, json_path: Path | None) -> None:
    """Load-test an OpenAI endpoint: Poisson or constant arrivals, synthetic lengths or a trace."""
    console = Console(stderr=False)
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if urlparse(url).scheme not in ("http", "https"):
        raise click.BadParameter(f"{url!r} is not an http(s) URL", param_hint="--url")
    try:
        problem = asyncio.run(_run(console, locals()))
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        console.print(f"[red]bench failed:[/red] {exc}")
        sys.exit(1)
    if problem is not None:
        console.print(f"[red]bench failed:[/red] {problem}")
        sys.exit(1)


async def _run(console: Console, o: dict[str, Any]) -> str | None:
    """Run the benchmark and print its report; return why it failed as a whole (no request completed)."""
    url = o["url"]
    notes: list[str] = []
    headers = {"Authorization": f"Bearer {o['api_key']}"} if o["api_key"] else {}
    async with httpx.AsyncClient(timeout=30.0, headers=headers) as c:
        model = o["model"] or await bench_client.model_name(c, url)
        sample = workload.prompt_text(workload.RequestSpec(0, CALIBRATION_WORDS, 1), -1, 1.0)
        tokens_per_word = await bench_client.calibrate(c, url, model, sample)
    length_scale = 1.0
    if o["trace"]:
        path = workload.resolve_trace(o["trace"])
        rows = workload.load_trace(path, o["num_requests"], o["trace_offset"])
        rate = o["rate"] if o["rate"] and o["time_scale"] is None else None
        time_scale = 0.0 if o["rate"] == 0 and o["time_scale"] is None else o["time_scale"]  # all at once
        specs, scaling = workload.scale_trace(
            rows, rate=rate, time_scale=time_scale, target_median_prompt=o["prompt_tokens"],
            length_scale=o["length_scale"], max_prompt_tokens=o["max_prompt_tokens"],
            max_output_tokens=o["max_output_tokens"])
        length_scale = scaling.length_scale
        notes.append(f"trace {path.name} rows {o['trace_offset']}..: {scaling.description}")
    else:
        rate = 1.0 if o["rate"] is None else o["rate"]
        specs = workload.synthetic(o["num_requests"], rate, o["arrival"], o["prompt_tokens"],
                                   o["output_tokens"], seed=o["seed"])
        pacing = (f"all {len(specs)} requests at once (--rate {rate:g})" if workload.all_at_once(rate)
                  else f"{o['arrival']} arrivals at {rate:g} req/s")
        notes.append(f"synthetic: {pacing}, "
                     f"{o['prompt_tokens']} prompt / {o['output_tokens']} output tokens (ignore_eos)")
    notes.append(f"prompts sized with {tokens_per_word:.2f} tokens/word measured on the server's tokenizer")
    prompts = [workload.prompt_text(s, i, tokens_per_word, length_scale=length_scale)
               for i, s in enumerate(specs)]
    console.print(f"benchmarking {model} at {url}: {len(specs)} requests (stops after {o['max_duration']:.0f}s)")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[failed]} failed"), console=console) as progress:
        task = progress.add_task("requests", total=len(specs), failed=0)
        failed = 0

        def done(r: bench_client.RequestResult) -> None:
            nonlocal failed
            failed += not r.ok
            progress.update(task, advance=1, failed=failed)

        results, wall = await bench_client.run_requests(
            url, model, specs, prompts, max_duration=o["max_duration"],
            request_timeout=o["request_timeout"], token_ids=o["per_token"], on_done=done, headers=headers)
    skipped = len(specs) - len(results)
    if skipped:
        notes.append(f"{skipped} requests not sent: their send time was past --max-duration")
    summary = summarize(results, wall, o["slo_ttft"], o["slo_itl"])
    print_summary(console, summary, f"tandem bench: {model}", notes)
    if o["json_path"] is not None:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in o.items() if k != "console"}
        write_json(o["json_path"], summary, {**config, "model": model}, notes)
        console.print(f"wrote {o['json_path']}")
    return overall_failure(results, len(specs))
