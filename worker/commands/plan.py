"""`tandem plan`: prefill and decode replica counts for a load and its SLOs, before deploying.

The sizing is tandem.operator.capacity_model (the predictive autoscaler's): from a measured
profile (--profile FILE, JSON with the capacity_model.Profile fields) or, without one, a GPU's
roofline estimate for a model of --params-b billion parameters. The load is a request rate with
mean prompt/output lengths, or a trace file (both formats in /work/shared/traces), sized at its
busiest --window seconds.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import click

from tandem.operator.capacity_model import CapacityError, PoolPlan, Profile, Slo, plan


@dataclass(frozen=True)
class Gpu:
    """Public datasheet figures: dense BF16 tensor FLOP/s, HBM bytes/s, memory bytes."""

    flops: float
    bandwidth: float
    memory: float


GPUS = {
    "h100": Gpu(989e12, 3.35e12, 80e9),
    "h200": Gpu(989e12, 4.8e12, 141e9),
    "a100": Gpu(312e12, 2.0e12, 80e9),
    "l40s": Gpu(362e12, 0.864e12, 48e9),
}
# Roofline efficiencies: what fraction of peak a serving engine reaches (rough, stated as such).
PREFILL_MFU = 0.5
DECODE_BW_EFFICIENCY = 0.7
KV_MEMORY_FRACTION = 0.9  # of what the weights leave


def roofline_profile(gpu: str, params_b: float, kv_bytes_per_token: float, mean_context: float,
                     bytes_per_param: float = 2.0, startup_s: float = 30.0) -> Profile:
    """An estimate, not a measurement: prefill at PREFILL_MFU of 2 x params FLOPs per token;
    a decode step reads the weights once plus each running request's KV."""
    spec = GPUS[gpu]
    weights = params_b * 1e9 * bytes_per_param
    if weights >= spec.memory:
        raise CapacityError(f"{params_b:g}B parameters ({weights / 1e9:.0f} GB) do not fit on one {gpu} "
                            f"({spec.memory / 1e9:.0f} GB); tensor parallelism is not modelled here")
    bandwidth = spec.bandwidth * DECODE_BW_EFFICIENCY
    return Profile(
        prefill_tps=spec.flops * PREFILL_MFU / (2 * params_b * 1e9),
        kv_tokens=(spec.memory - weights) * KV_MEMORY_FRACTION / kv_bytes_per_token,
        itl_base_s=weights / bandwidth,
        itl_per_seq_s=mean_context * kv_bytes_per_token / bandwidth,
        startup_s=startup_s,
        source=f"roofline estimate: {gpu}, {params_b:g}B params, {kv_bytes_per_token:g} KV bytes/token",
    )


@dataclass(frozen=True)
class Load:
    rate: float
    mean_prompt: float
    mean_output: float
    what: str
    # The length distributions, where known: (p50, p90, p99) of the prompt and the output tokens.
    prompt_quantiles: tuple[float, float, float] | None = None
    output_quantiles: tuple[float, float, float] | None = None


QUANTILES = (0.5, 0.9, 0.99)


def quantiles(values: list[int]) -> tuple[float, float, float]:
    """(p50, p90, p99), nearest rank."""
    ordered = sorted(values)
    q = [ordered[min(len(ordered) - 1, max(0, math.ceil(p * len(ordered)) - 1))] for p in QUANTILES]
    return float(q[0]), float(q[1]), float(q[2])


def with_lengths(load: Load, rows: list[tuple[float, int, int]]) -> Load:
    """`load` with the prompt and output length quantiles of `rows`."""
    return replace(load, prompt_quantiles=quantiles([r[1] for r in rows]),
                   output_quantiles=quantiles([r[2] for r in rows]))


def tail_warnings(load: Load, profile: Profile, slo: Slo) -> list[str]:
    """What the means hide: a long prompt's prefill alone, on one replica, may take longer than the TTFT
    SLO (whatever the replica count: more replicas do not make one prompt faster)."""
    if load.prompt_quantiles is None:
        return []
    out = []
    for name, tokens in zip(("p90", "p99"), load.prompt_quantiles[1:], strict=True):
        alone = tokens / profile.prefill_tps
        if alone > slo.ttft_s:
            out.append(f"the {name} prompt ({tokens:.0f} tokens) takes {alone:.2f} s to prefill on one replica, "
                       f"more than the TTFT SLO ({slo.ttft_s * 1000:.0f} ms): those requests miss it at any "
                       f"replica count (a faster replica, or tensor parallelism, is what helps)")
    return out


def busiest_window(arrivals: list[tuple[float, int, int]], window_s: float, absorb_s: float = 0.0) -> Load:
    """The window of `window_s` with the most prompt tokens, as a rate over window + `absorb_s`
    (a queue may hold a burst's excess for up to the TTFT SLO), with its mean lengths."""
    if not arrivals:
        raise CapacityError("the trace has no requests")
    arrivals = sorted(arrivals)
    span = arrivals[-1][0] - arrivals[0][0]
    window = min(window_s, span) if span > 0 else 1.0
    best, best_tokens, lo, tokens = (0, 0), -1, 0, 0
    for hi, (t, prompt, _) in enumerate(arrivals):
        tokens += prompt
        while arrivals[lo][0] <= t - window:
            tokens -= arrivals[lo][1]
            lo += 1
        if tokens > best_tokens:
            best, best_tokens = (lo, hi), tokens
    chunk = arrivals[best[0]:best[1] + 1]
    return with_lengths(Load(len(chunk) / (window + absorb_s), sum(r[1] for r in chunk) / len(chunk),
                             sum(r[2] for r in chunk) / len(chunk), f"busiest {window:g} s of the trace"), chunk)


# Burst lengths a trace is examined at: the sizing takes the one that needs the most.
BURST_WINDOWS_S = (5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0)


def peak_load(arrivals: list[tuple[float, int, int]], ttft_s: float, windows: tuple[float, ...] = BURST_WINDOWS_S) -> Load:
    """The load to size for: over bursts of each length W, the prompt tokens of the busiest W
    seconds spread over W + TTFT (what the queue may absorb within the SLO); the largest."""
    return max((busiest_window(arrivals, w, ttft_s) for w in windows), key=lambda ld: ld.rate * ld.mean_prompt)


def mean_load(arrivals: list[tuple[float, int, int]]) -> Load:
    span = max(a[0] for a in arrivals) - min(a[0] for a in arrivals)
    n = len(arrivals)
    return with_lengths(Load(n / span if span > 0 else float(n), sum(a[1] for a in arrivals) / n,
                             sum(a[2] for a in arrivals) / n, "whole trace"), arrivals)


def read_trace(name: str, time_scale: float, length_scale: float) -> list[tuple[float, int, int]]:
    """(arrival s, prompt, output) rows, arrivals `time_scale` x faster, lengths x `length_scale`."""
    from tandem.worker.bench.workload import load_trace, resolve_trace

    rows = load_trace(resolve_trace(name), limit=sys.maxsize)
    return [(r.arrival / time_scale, max(1, round(r.prompt_tokens * length_scale)),
             max(1, round(r.output_tokens * length_scale))) for r in rows]


def pool_yaml(peak: PoolPlan, base: PoolPlan, slo: Slo) -> dict[str, Any]:
    """The DisaggregatedModel fields to paste: pool sizes, autoscaling bounds, SLOs, ratio band."""
    def pool(n: int, low: int) -> dict[str, Any]:
        return {"replicas": n, "autoscaling": {"enabled": True, "minReplicas": max(1, low),
                                               "maxReplicas": max(2 * n, low + 1)}}

    ratios = (peak.prefill / peak.decode, base.prefill / base.decode)
    return {"spec": {
        "prefill": pool(peak.prefill, base.prefill),
        "decode": pool(peak.decode, base.decode),
        "slo": {"ttftMs": round(slo.ttft_s * 1000), "itlMs": round(slo.itl_s * 1000)},
        "ratio": {"minPrefillPerDecode": round(min(ratios) / 2, 3), "maxPrefillPerDecode": round(max(ratios) * 2, 3)},
    }}


def describe(result: PoolPlan, load: Load, profile: Profile, slo: Slo) -> str:
    lengths = []
    if load.prompt_quantiles is not None and load.output_quantiles is not None:
        lengths = [f"lengths      prompt p50/p90/p99 {'/'.join(f'{q:.0f}' for q in load.prompt_quantiles)}, "
                   f"output {'/'.join(f'{q:.0f}' for q in load.output_quantiles)} tokens"]
    return "\n".join([
        f"load         {load.rate:.3g} req/s ({load.what}), mean prompt {load.mean_prompt:.0f}, "
        f"mean output {load.mean_output:.0f} tokens",
        *lengths,
        f"profile      {profile.source}: prefill {profile.prefill_tps:.0f} tok/s, KV {profile.kv_tokens:.0f} tokens, "
        f"ITL {profile.itl_base_s * 1000:.1f} ms + {profile.itl_per_seq_s * 1000:.3f} ms/request",
        f"prefill      {result.prefill} replicas (busy {result.prefill_utilization:.0%} at this load)",
        f"decode       {result.decode} replicas (ITL {result.decode_itl_s * 1000:.1f} ms, "
        f"KV {result.decode_kv_fill:.0%} full)",
        f"P:D ratio    {result.ratio():.2f}",
        f"GPUs         {result.gpus}",
        f"goodput      {result.goodput_rps:.3g} req/s within TTFT {slo.ttft_s * 1000:.0f} ms and "
        f"ITL {slo.itl_s * 1000:.0f} ms",
        f"bottleneck   {result.bottleneck}",
        *(f"warning      {w}" for w in tail_warnings(load, profile, slo)),
    ])


@click.command("plan")
@click.option("--profile", "profile_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Measured profile (JSON: prefill_tps, kv_tokens, itl_base_s, itl_per_seq_s, startup_s, ...).")
@click.option("--gpu", type=click.Choice(sorted(GPUS)), help="Without --profile: the GPU for a roofline estimate.")
@click.option("--params-b", type=float, help="Roofline: model parameters, billions.")
@click.option("--kv-bytes-per-token", type=float, default=131072.0, show_default=True,
              help="Roofline: KV bytes per token (2 x layers x KV heads x head dim x 2 bytes; 128 KiB: Llama-3-8B).")
@click.option("--trace", help="Trace file (.jsonl Mooncake or .csv Azure format) or mooncake / azure-code.")
@click.option("--time-scale", type=float, default=1.0, show_default=True, help="Trace arrivals this many times faster.")
@click.option("--length-scale", type=float, default=1.0, show_default=True, help="Trace token counts x this.")
@click.option("--window", type=float, default=None,
              help="Size a trace at its busiest window of this many s (default: the burst length, 5 s to 5 min, "
                   "that needs the most, counting what the TTFT SLO lets a queue absorb).")
@click.option("--rate", type=float, help="Without --trace: requests/s.")
@click.option("--isl", type=float, help="Without --trace: mean prompt tokens.")
@click.option("--osl", type=float, help="Without --trace: mean output tokens.")
@click.option("--isl-p90", type=float, help="Without --trace: the 90th-percentile prompt, for the tail check.")
@click.option("--isl-p99", type=float, help="Without --trace: the 99th-percentile prompt, for the tail check.")
@click.option("--ttft-ms", type=float, default=2000.0, show_default=True)
@click.option("--itl-ms", type=float, default=100.0, show_default=True)
@click.option("--format", "fmt", type=click.Choice(["text", "yaml"]), default="text", show_default=True)
def command(profile_path: Path | None, gpu: str | None, params_b: float | None, kv_bytes_per_token: float,
            trace: str | None, time_scale: float, length_scale: float, window: float | None, rate: float | None,
            isl: float | None, osl: float | None, isl_p90: float | None, isl_p99: float | None, ttft_ms: float,
            itl_ms: float, fmt: str) -> None:
    """Size the prefill and decode pools for a load and TTFT/ITL SLOs."""
    try:
        slo = Slo(ttft_ms / 1000, itl_ms / 1000)
        if trace:
            if min(time_scale, length_scale, window or 1.0) <= 0:
                raise click.UsageError("--time-scale, --length-scale and --window must be positive")
            try:
                rows = read_trace(trace, time_scale, length_scale)
            except (OSError, ValueError, KeyError) as exc:
                raise click.UsageError(f"cannot read trace {trace!r}: {exc}") from None
            load = busiest_window(rows, window) if window else peak_load(rows, slo.ttft_s)
            base = mean_load(rows)
        elif rate and isl and osl:
            load = base = Load(rate, isl, osl, "given")
            if isl_p90 or isl_p99:  # the tail check needs only the prompt's
                tail = (isl, isl_p90 or isl, isl_p99 or isl_p90 or isl)
                load = base = replace(load, prompt_quantiles=tail, output_quantiles=(osl, osl, osl))
        else:
            raise click.UsageError("give --trace, or all of --rate, --isl and --osl")
        if profile_path:
            profile = Profile.load(profile_path)
        elif gpu and params_b:
            profile = roofline_profile(gpu, params_b, kv_bytes_per_token, load.mean_prompt + load.mean_output / 2)
        else:
            raise click.UsageError("give --profile FILE, or --gpu and --params-b for a roofline estimate")
        peak = plan(load.rate, load.mean_prompt, load.mean_output, profile, slo)
        low = plan(base.rate, base.mean_prompt, base.mean_output, profile, slo)
    except CapacityError as exc:
        raise click.ClickException(str(exc)) from None
    if fmt == "yaml":
        import yaml

        click.echo(f"# tandem plan: {load.what}, {load.rate:.3g} req/s; {profile.source}")
        for warning in tail_warnings(load, profile, slo):
            click.echo(f"# warning: {warning}")
        click.echo(yaml.safe_dump(pool_yaml(peak, low, slo), sort_keys=False).rstrip())
    else:
        click.echo(describe(peak, load, profile, slo))
        if base is not load:
            click.echo(f"at the mean  {low.prefill} prefill / {low.decode} decode ({base.rate:.3g} req/s)")
