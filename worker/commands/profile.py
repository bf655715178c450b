"""`tandem profile`: measure one worker into a capacity profile (what `tandem plan --profile` reads).

The numbers come from the worker's own control API, the requests the router sends a worker in
monolithic mode (/generate), timed on this side, with the worker's histograms on /metrics beside them:

- prefill: B concurrent prompts of L random tokens each with max_tokens 1; prompt tokens/s is
  B x L over the time from the first request sent to the last answer in (the HTTP path included);
  the profile's prefill_tps is the most loaded cell's (longest prompt, largest batch: what a busy
  replica runs), the table keeps every cell;
- decode: B concurrent streams of prompts of C tokens generating --decode-tokens each, ignoring EOS;
  ITL is the time over the tokens that arrive while all B streams are decoding (after the last first
  token, before the first stream ends), so no prefill lands in it; ITL = base + per_seq x B is fitted
  per context (least squares), and a + b x B + c x B x context over all of them;
- KV capacity: the worker's KV blocks (/info stats, /metrics tandem_kv_cache_total_blocks) x block size;
- startup (--model only): from starting a real `tandem worker` process to its first 200 on /ready.

The file holds the capacity_model.Profile fields plus `metadata` and `measurements`, which
Profile.load skips (capacity_model.INFORMATIONAL_KEYS). docs/autoscaling.md, "Measuring a profile".
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import json
import os
import platform
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import click
import httpx

from tandem.operator.capacity_model import CapacityError, Profile
from tandem.worker import metrics as m
from tandem.worker.server import control_token
from tandem.worker.server.control_token import ControlTokenError, ControlTokens
from tandem.worker.server.ports import free_port
from tandem.worker.server.protocol import GenerateRequest, Sampling

DEFAULT_STARTUP_S = Profile.__dataclass_fields__["startup_s"].default  # 30 s, when not measured
READY_POLL_S = 0.05
MIN_GAPS = 3  # decode gaps a cell needs in its steady window to count
PORT_ATTEMPTS = 3


class ProfileError(Exception):
    """The measurement cannot go on (worker unreachable, refused a request, exited...)."""


def _int_list(_ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of whole numbers",
                                 param_hint=f"--{param.name.replace('_', '-') if param.name else '?'}") from None
    if not items or min(items) < 1:
        raise click.BadParameter(f"{value!r}: give one or more whole numbers, each at least 1",
                                 param_hint=f"--{param.name.replace('_', '-') if param.name else '?'}")
    return sorted(set(items))


@dataclass
class Stream:
    """One /generate as the client saw it: when it was sent, and (time, tokens) for each chunk of tokens."""

    sent: float
    events: list[tuple[float, int]] = field(default_factory=list)
    done: float = 0.0
    error: str | None = None


class WorkerClient:
    def __init__(self, url: str, headers: dict[str, str], concurrency: int) -> None:
        self.url = url.rstrip("/")
        limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
        self.http = httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(600.0, connect=5.0))

    async def close(self) -> None:
        await self.http.aclose()

    async def get_json(self, path: str) -> Any:
        try:
            resp = await self.http.get(f"{self.url}{path}", timeout=10.0)
        except httpx.HTTPError as exc:
            raise ProfileError(f"cannot reach the worker at {self.url}{path}: {type(exc).__name__}: {exc}") from None
        if resp.status_code in (401, 403):
            sent = control_token.HEADER in self.http.headers
            raise ProfileError(f"{self.url}{path} answered {resp.status_code}: "
                               + ("it does not take this control token" if sent else "it wants a control token")
                               + f"; give the worker's with --control-token-file FILE or ${control_token.ENV_TOKEN}")
        if resp.status_code != 200:
            raise ProfileError(f"{self.url}{path}: HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            return resp.json()
        except ValueError:
            raise ProfileError(f"{self.url}{path} answered something that is not JSON: is this a tandem worker?") from None

    async def metric_totals(self, *names: str) -> dict[str, float]:
        """Each sample name's value summed over its label sets (histograms: name_sum, name_count)."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = (await self.http.get(f"{self.url}/metrics", timeout=10.0)).text
        except httpx.HTTPError:
            return {}
        totals = dict.fromkeys(names, 0.0)
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in totals:
                        totals[sample.name] += float(sample.value)
        except ValueError:
            return {}
        return totals

    async def generate(self, prompt: list[int], max_tokens: int) -> Stream:
        body = GenerateRequest.model_validate({
            "request_id": f"profile-{uuid.uuid4().hex[:12]}", "prompt_token_ids": prompt, "deadline_s": 600.0,
            "sampling": Sampling.model_validate({"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})})
        stream = Stream(time.perf_counter())
        try:
            async with self.http.stream("POST", f"{self.url}/generate", content=body.model_dump_json(),
                                        headers={"content-type": "application/json"}) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    stream.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                    return stream
                async for line in resp.aiter_lines():
                    if not line.strip():  # a heartbeat
                        continue
                    chunk = json.loads(line)
                    if chunk.get("token_ids"):
                        stream.events.append((time.perf_counter(), len(chunk["token_ids"])))
                    if chunk.get("error"):
                        stream.error = str(chunk["error"])
                    if chunk.get("finished"):
                        break
        except (httpx.HTTPError, ValueError) as exc:
            stream.error = f"{type(exc).__name__}: {exc}"
        stream.done = time.perf_counter()
        got = sum(n for _, n in stream.events)
        if stream.error is None and got != max_tokens:
            stream.error = f"{got} of {max_tokens} tokens"
        return stream


# --- measurement ---

@dataclass
class Bounds:
    prompt_lengths: list[int]
    batch_sizes: list[int]
    contexts: list[int]
    decode_tokens: int
    repeats: int


class Profiler:
    def __init__(self, client: WorkerClient, bounds: Bounds, say: Callable[[str], None], seed: int = 0) -> None:
        self.client, self.bounds, self.say = client, bounds, say
        self.rng = random.Random(seed)
        self.token_range = (10, 500)
        self.skipped: list[str] = []
        self.max_model_len = self.max_prompt = 1 << 30  # the worker's, once /info has said

    def prompt(self, n: int) -> list[int]:
        # Random ids: no two prompts share a prefix, so the prefix cache computes nothing away.
        lo, hi = self.token_range
        return [self.rng.randrange(lo, hi) for _ in range(n)]

    async def batch(self, prompts: Sequence[list[int]], max_tokens: int) -> tuple[float, list[Stream]]:
        start = time.perf_counter()
        streams = await asyncio.gather(*(self.client.generate(p, max_tokens) for p in prompts))
        failed = [s.error for s in streams if s.error]
        if failed:
            raise ProfileError(f"{len(failed)} of {len(streams)} requests failed on the worker: {failed[0]}")
        return start, list(streams)

    async def info(self) -> dict[str, Any]:
        info = await self.client.get_json("/info")
        if not isinstance(info, dict) or "role" not in info:
            raise ProfileError(f"{self.client.url}/info is not a tandem worker's answer: {str(info)[:200]}")
        if info["role"] not in ("both", "decode"):
            raise ProfileError(f"{self.client.url} is a {info['role']} worker, which serves no /generate: profile a "
                               f"worker of role both (or decode)")
        if not info.get("ready"):
            raise ProfileError(f"the worker at {self.client.url} is not ready (load progress "
                               f"{info.get('load_progress', 0):.0%}, draining {info.get('draining')})")
        return info

    async def vocabulary(self) -> None:
        """Prompt ids below the vocabulary (the tokenizer's) and clear of its special tokens' usual low ids."""
        try:
            data = await self.client.get_json("/tokenizer")
            vocab = json.loads(data["files"]["tokenizer.json"])["model"]["vocab"]
            size = len(vocab)
        except (ProfileError, KeyError, TypeError, ValueError):
            return
        self.token_range = (min(10, size // 2), max(11, min(size, 30_000)))

    async def kv_capacity(self, info: dict[str, Any]) -> dict[str, Any]:
        blocks = int(info.get("stats", {}).get("num_total_blocks") or 0)
        block_size = int(info.get("block_size") or 0)
        if blocks < 1 or block_size < 1:
            raise ProfileError(f"the worker's /info names no KV blocks (stats.num_total_blocks {blocks}, block_size "
                               f"{block_size})")
        return {"blocks": blocks, "block_size": block_size, "tokens": blocks * block_size,
                "metrics_total_blocks": None, "max_model_len": int(info.get("max_model_len") or 0),
                "how": "/info stats.num_total_blocks x block_size"}

    async def warm_up(self) -> None:
        longest = max(self.bounds.prompt_lengths + self.bounds.contexts)
        self.say(f"warming up ({longest}-token prompt, then {self.bounds.decode_tokens} tokens of decode)")
        await self.batch([self.prompt(min(longest, self.max_prompt))], 1)
        await self.batch([self.prompt(16) for _ in range(min(4, max(self.bounds.batch_sizes)))],
                         min(self.bounds.decode_tokens, self.max_model_len - 16))

    async def prefill_cell(self, length: int, batch: int) -> dict[str, Any]:
        ttft_names = (m.TTFT.name + "_sum", m.TTFT.name + "_count")
        runs: list[dict[str, Any]] = []
        for run in range(self.bounds.repeats):
            before = await self.client.metric_totals(*ttft_names)
            start, streams = await self.batch([self.prompt(length) for _ in range(batch)], 1)
            wall = max(s.done for s in streams) - start
            after = await self.client.metric_totals(*ttft_names)
            worker_ttft = _mean_delta(before, after, m.TTFT.name)
            ttfts = [s.events[0][0] - s.sent for s in streams]
            runs.append({"wall_s": wall, "tokens_per_s": batch * length / wall,
                         "ttft_median_s": statistics.median(ttfts), "ttft_max_s": max(ttfts),
                         "worker_ttft_mean_s": worker_ttft})
            self.say(f"prefill {length:>6} tokens x {batch:>3}: {batch * length / wall:>10.0f} tok/s, "
                     f"TTFT median {statistics.median(ttfts) * 1000:.1f} ms (run {run + 1}/{self.bounds.repeats})")
        return {"prompt_tokens": length, "batch": batch,
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                "ttft_median_s": statistics.median(r["ttft_median_s"] for r in runs), "runs": runs}

    async def decode_cell(self, batch: int, context: int) -> dict[str, Any]:
        itl_names = (m.ITL.name + "_sum", m.ITL.name + "_count")
        tokens = self.bounds.decode_tokens
        gaps: list[float] = []
        span, counted = 0.0, 0
        runs: list[dict[str, Any]] = []
        for run in range(self.bounds.repeats):
            before = await self.client.metric_totals(*itl_names)
            _, streams = await self.batch([self.prompt(context) for _ in range(batch)], tokens)
            after = await self.client.metric_totals(*itl_names)
            window = steady_window(streams)
            gaps += window.gaps
            span, counted = span + window.span_s, counted + window.tokens
            itl = window.span_s / window.tokens if window.tokens else None
            runs.append({"steady_tokens": window.tokens, "itl_s": itl,
                         "gap_median_s": statistics.median(window.gaps) if window.gaps else None,
                         "worker_itl_mean_s": _mean_delta(before, after, m.ITL.name)})
            shown = f"{itl * 1000:.2f} ms" if itl else "no steady window"
            self.say(f"decode  batch {batch:>3}, context {context:>6}: ITL {shown} over {window.tokens} tokens "
                     f"(run {run + 1}/{self.bounds.repeats})")
        cell: dict[str, Any] = {"batch": batch, "context_tokens": context, "decode_tokens": tokens,
                                "steady_tokens": counted, "runs": runs}
        if counted >= MIN_GAPS:
            cell.update(itl_s=span / counted, gap_median_s=statistics.median(gaps), gap_p90_s=_quantile(gaps, 0.9))
        else:
            cell["itl_s"] = None
            self.skipped.append(f"decode batch {batch} context {context}: fewer than {MIN_GAPS} tokens while every "
                                f"stream was decoding (raise --decode-tokens)")
        return cell

    async def run(self) -> dict[str, Any]:
        info = await self.info()
        await self.vocabulary()
        kv = await self.kv_capacity(info)
        self.max_model_len = kv["max_model_len"] or self.max_model_len
        self.max_prompt = self.max_model_len - 1
        self.say(f"worker {self.client.url}: model {info.get('model')}, role {info['role']}, KV {kv['tokens']} tokens "
                 f"({kv['blocks']} blocks of {kv['block_size']}), max_model_len {kv['max_model_len']}")
        await self.warm_up()
        # The gauge is set on engine steps: read it once some have run.
        kv["metrics_total_blocks"] = (await self.client.metric_totals(m.KV_TOTAL_BLOCKS.name)).get(m.KV_TOTAL_BLOCKS.name)
        prefill = []
        for length in self.bounds.prompt_lengths:
            if length >= self.max_model_len:
                self.skipped.append(f"prefill {length} tokens: not below max_model_len {self.max_model_len}")
                continue
            for batch in self.bounds.batch_sizes:
                prefill.append(await self.prefill_cell(length, batch))
        decode = []
        for context in self.bounds.contexts:
            if context + self.bounds.decode_tokens > self.max_model_len:
                self.skipped.append(f"decode context {context}: with {self.bounds.decode_tokens} tokens of decode it "
                                    f"passes max_model_len {self.max_model_len}")
                continue
            for batch in self.bounds.batch_sizes:
                if batch * (context + self.bounds.decode_tokens) > kv["tokens"]:
                    self.skipped.append(f"decode batch {batch} context {context}: more KV than the worker holds "
                                        f"({kv['tokens']} tokens)")
                    continue
                decode.append(await self.decode_cell(batch, context))
        if not prefill:
            raise ProfileError(f"no prefill measurement: every --prompt-lengths value is at or above max_model_len "
                               f"{self.max_model_len}")
        if not any(c["itl_s"] for c in decode):
            raise ProfileError("no decode measurement: " + ("; ".join(self.skipped) or "no cell was measured"))
        return {"info": info, "kv": kv, "prefill": prefill, "decode": decode, "skipped": self.skipped}


@dataclass
class Window:
    gaps: list[float]  # per-token gaps, each chunk's gap divided by its tokens
    span_s: float  # summed over the streams: first to last token time inside the window
    tokens: int  # summed over the streams: tokens that arrived inside the window after its first


def steady_window(streams: Sequence[Stream]) -> Window:
    """The tokens of every stream while all of them were decoding: after the last stream's first token
    (no prefill of this batch is left) and up to the first stream's last token (none has left).

    The window's ITL is span / tokens: only its end points count, so tokens that reached this side
    bunched together (the client was descheduled, then read several lines at once: a long gap and
    some of nearly 0) still average to the worker's pace. The single gaps' median is kept, not used."""
    window = Window([], 0.0, 0)
    if not streams or any(len(s.events) < 2 for s in streams):
        return window
    start = max(s.events[0][0] for s in streams)
    end = min(s.events[-1][0] for s in streams)
    for s in streams:
        inside = [(t, n) for t, n in s.events if start <= t <= end]
        if len(inside) < 2:
            continue
        window.span_s += inside[-1][0] - inside[0][0]
        window.tokens += sum(n for _, n in inside[1:])
        window.gaps += [(t1 - t0) / n for (t0, _), (t1, n) in itertools.pairwise(inside)]
    return window


def _quantile(values: list[float], q: float) -> float:
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean_delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    try:
        count = after[name + "_count"] - before[name + "_count"]
        return (after[name + "_sum"] - before[name + "_sum"]) / count if count > 0 else None
    except KeyError:
        return None


# --- fits ---

def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope); one distinct x: (mean y, 0)."""
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    if len(set(xs)) < 2:
        return statistics.fmean(ys), 0.0
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def itl_fit(points: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """ITL = base + per_seq x batch, as the Profile wants it: per_seq at least 0, base above 0."""
    base, per_seq = fit_line(points)
    notes = []
    if per_seq < 0:
        notes.append(f"the fitted slope was {per_seq:.3g} s per request (noise): taken as 0, base the mean")
        base, per_seq = statistics.fmean(p[1] for p in points), 0.0
    if base <= 0:  # faster than linear growth, or noise: anchor the base at half the smallest ITL
        notes.append(f"the fitted base was {base:.3g} s: taken as half the smallest measured ITL, the slope "
                     f"fitted through it")
        base = min(p[1] for p in points) / 2
        per_seq = max(0.0, sum(b * (y - base) for b, y in points) / sum(b * b for b, _ in points))
    worst = max(abs(base + per_seq * b - y) / y for b, y in points)
    return {"base_s": base, "per_seq_s": per_seq, "points": len(points), "max_relative_error": worst,
            **({"notes": notes} if notes else {})}


def itl_fit_with_context(points: Sequence[tuple[float, float, float]]) -> dict[str, Any] | None:
    """ITL = a + b x batch + c x batch x context over every cell (least squares): per_seq at a mean
    context C is b + c x C. None when the cells do not determine it (one context or one batch size)."""
    rows = [(1.0, b, b * c) for b, c, _ in points]
    ys = [y for _, _, y in points]
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(3)]
    solution = _solve3(ata, aty)
    if solution is None:
        return None
    a, b, c = solution
    return {"base_s": a, "per_seq_s": b, "per_seq_per_context_token_s": c, "points": len(points),
            "formula": "itl_s = base_s + (per_seq_s + per_seq_per_context_token_s x context) x batch"}


def _solve3(a: list[list[float]], y: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    m_ = [[*row, v] for row, v in zip(a, y, strict=True)]
    scale = max(abs(v) for row in a for v in row) or 1.0
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m_[r][col]))
        if abs(m_[pivot][col]) < 1e-12 * scale:
            return None
        m_[col], m_[pivot] = m_[pivot], m_[col]
        for r in range(3):
            if r != col:
                f = m_[r][col] / m_[col][col]
                m_[r] = [x - f * p for x, p in zip(m_[r], m_[col], strict=True)]
    return [m_[i][3] / m_[i][i] for i in range(3)]


def build_profile(measured: dict[str, Any], startup: dict[str, Any], fit_context: int | None, source: str,
                  gpus_per_replica: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Profile fields and the `measurements` section from what was measured."""
    # A busy prefill replica runs the prompts queued at it together: its rate is the saturated cell's
    # (the most prompt tokens at once: the longest prompt at the largest batch), not the best cell's.
    saturated = max(measured["prefill"], key=lambda c: (c["prompt_tokens"] * c["batch"], c["prompt_tokens"]))
    fastest = max(measured["prefill"], key=lambda c: c["tokens_per_s"])
    by_context: dict[int, list[tuple[float, float]]] = {}
    for cell in measured["decode"]:
        if cell["itl_s"]:
            by_context.setdefault(cell["context_tokens"], []).append((cell["batch"], cell["itl_s"]))
    fits = [{"context_tokens": c, **itl_fit(points)} for c, points in sorted(by_context.items())]
    chosen = fits[-1] if fit_context is None else min(fits, key=lambda f: abs(f["context_tokens"] - fit_context))
    tokens = measured["decode"][0]["decode_tokens"] if measured["decode"] else 0
    with_context = itl_fit_with_context([(c["batch"], c["context_tokens"] + tokens / 2, c["itl_s"])
                                         for c in measured["decode"] if c["itl_s"]])
    fields = {
        "prefill_tps": saturated["tokens_per_s"],
        "kv_tokens": float(measured["kv"]["tokens"]),
        "itl_base_s": chosen["base_s"],
        "itl_per_seq_s": chosen["per_seq_s"],
        "startup_s": startup["seconds"],
        "gpus_per_replica": gpus_per_replica,
        "source": source,
    }
    Profile.from_dict(fields)  # the numbers must make a valid profile before anything is written
    measurements = {
        "how": {
            "prefill_tps": f"prompt tokens/s of the prefill table's most loaded cell ({saturated['prompt_tokens']}-token "
                           f"prompts, {saturated['batch']} at once: a busy replica runs its queue together); each cell is "
                           f"B concurrent /generate requests with max_tokens 1, B x prompt tokens over the time from "
                           f"the first sent to the last answered (client side), the median of the runs. The fastest "
                           f"cell: {fastest['tokens_per_s']:.0f} tok/s ({fastest['prompt_tokens']} tokens x "
                           f"{fastest['batch']})",
            "kv_tokens": measured["kv"]["how"],
            "itl": f"least-squares fit ITL = base + per_seq x batch of the decode table's itl_s at context "
                   f"{chosen['context_tokens']} tokens (the prompt; each stream adds up to {tokens} while measured); "
                   f"a cell's itl_s is the time over the tokens that arrived while every stream of its batch was "
                   f"decoding (client side, all runs together)",
            "startup_s": startup["how"],
        },
        "prefill": measured["prefill"],
        "decode": measured["decode"],
        "itl_fits": fits,
        "itl_fit_with_context": with_context,
        "kv": measured["kv"],
        "startup": startup,
        "skipped": measured["skipped"],
    }
    return fields, measurements


# --- the worker process (--model) ---

@dataclass
class StartedWorker:
    popen: subprocess.Popen[bytes]
    url: str
    log_path: Path
    argv: list[str]
    startup_s: float

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)


def start_worker(argv_tail: list[str], log_path: Path, timeout_s: float, say: Callable[[str], None],
                 env: dict[str, str]) -> StartedWorker:
    """Start `tandem worker ...` and wait for its /ready; the startup time is process start to that 200.
    A worker that could not bind its ports (another process took one after free_port) is started again."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        argv = [sys.executable, "-m", "tandem.worker.cli", "worker", *argv_tail, "--host", "127.0.0.1",
                "--port", str(port), "--kv-port", str(free_port())]
        with log_path.open("wb") as log:
            start = time.monotonic()
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, start_new_session=True)
        worker = StartedWorker(popen, f"http://127.0.0.1:{port}", log_path, argv, 0.0)
        try:
            return _wait_ready(worker, start, timeout_s, say)
        except ProfileError:
            worker.stop()
            if attempt < PORT_ATTEMPTS and popen.returncode is not None and \
                    "address already in use" in worker.log_tail(40).lower():
                say(f"the worker's port {port} or its KV port was taken meanwhile: starting it again")
                continue
            raise
        except BaseException:  # Ctrl-C or SIGTERM while it loads: the worker goes too
            worker.stop()
            raise
    raise AssertionError("unreachable")


def _wait_ready(worker: StartedWorker, start: float, timeout_s: float, say: Callable[[str], None]) -> StartedWorker:
    popen, url, log_path = worker.popen, worker.url, worker.log_path
    shown = -1
    with httpx.Client() as client:
        while True:
            now = time.monotonic()
            if popen.poll() is not None:
                raise ProfileError(f"the worker exited with status {popen.returncode} before it was ready; the end of "
                                   f"its log ({log_path}):\n{worker.log_tail()}")
            if now - start > timeout_s:
                raise ProfileError(f"the worker was not ready within {timeout_s:g} s (--startup-timeout); the end of "
                                   f"its log ({log_path}):\n{worker.log_tail()}")
            try:
                resp = client.get(f"{url}/ready", timeout=2.0)
                if resp.status_code == 200:
                    worker.startup_s = time.monotonic() - start
                    return worker
                body = resp.json()
                if body.get("error"):
                    raise ProfileError(f"the worker failed to load: {body['error']}\n{worker.log_tail()}")
                if int(now - start) // 10 > shown:
                    shown = int(now - start) // 10
                    say(f"waiting for the worker: {now - start:.0f} s, loading {body.get('load_progress', 0):.0%}")
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(READY_POLL_S)


# --- metadata ---

def _host() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    host: dict[str, Any] = {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version()}
    with contextlib.suppress(AttributeError, OSError):
        host["cpus_usable"] = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError):
        host["load_average_at_start"] = [round(v, 2) for v in os.getloadavg()]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                host["memory_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    return host


def _gpus() -> list[str]:
    """GPU names from nvidia-smi (no CUDA context in this process: it would take memory from the worker)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("tandem-serving")
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree (hack/gpu_checks.sh)
        import tomllib

        try:
            project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
            return f"{project['version']} (source tree, not installed)"
        except (OSError, KeyError, ValueError):
            return "unknown (not installed)"


def _command_line(params: dict[str, Any]) -> str:
    args = sys.argv[1:]
    if "profile" in args:
        return shlex.join(["tandem", *args[args.index("profile"):]])
    return "tandem profile " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in params.items() if v not in (None, False))


def _describe_device(device: str, gpus: list[str], host: dict[str, Any]) -> str:
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        return gpus[index].split(",")[0] if index < len(gpus) else device
    return f"{host.get('cpus_usable', host.get('cpu_count'))} CPU cores"


# --- the command ---

def _resolve_model(model: str, family: str) -> tuple[Path, str]:
    from rich.console import Console

    # tiny, a Hub id or a folder, as `tandem serve` takes them
    from tandem.worker.commands.serve import resolve_model

    path = Path(model).expanduser()
    if model != "tiny" and (path.is_absolute() or model.startswith(".") or path.exists()) and not path.is_dir():
        raise click.BadParameter(f"{model} is not a folder", param_hint="--model")
    return resolve_model(model, family, Console(stderr=True))


@click.command("profile")
@click.option("--model", "model", default=None,
              help="Start a worker of this model and measure it: a Hugging Face style folder, a Hub id ORG/NAME, "
                   "or `tiny` (the small random model `tandem serve --model tiny` uses).")
@click.option("--url", default=None, help="Measure a worker that already runs (role both or decode), e.g. "
                                          "http://10.0.0.5:8000; then the startup time is not measured.")
@click.option("--device", default="auto", show_default=True, help="With --model: auto, cpu or cuda[:N].")
@click.option("--dtype", default="auto", show_default=True, help="With --model: the worker's --dtype.")
@click.option("--family", default="llama", show_default=True, help="With --model tiny: its architecture.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=Path("profile.json"),
              show_default=True, help="Where to write the profile (JSON); - for stdout.")
@click.option("--prompt-lengths", callback=_int_list, default="64,256,1024", show_default=True,
              help="Prefill: prompt tokens per request.")
@click.option("--batch-sizes", callback=_int_list, default="1,4,16", show_default=True,
              help="Requests at once, for prefill and decode.")
@click.option("--contexts", callback=_int_list, default="64,512", show_default=True,
              help="Decode: prompt tokens of each stream (its context when decoding starts).")
@click.option("--decode-tokens", type=click.IntRange(4, 4096), default=32, show_default=True,
              help="Decode: tokens each stream generates (more: a longer steady window, slower).")
@click.option("--repeats", type=click.IntRange(1, 20), default=2, show_default=True, help="Runs of each cell.")
@click.option("--fit-context", type=click.IntRange(1), default=None,
              help="Decode context whose fit gives itl_base_s and itl_per_seq_s (default: the largest measured).")
@click.option("--startup-s", type=click.FloatRange(0), default=None,
              help="Startup seconds to write into the profile instead of the measured one (a pod's, say, with "
                   f"scheduling and image pull); with --url, where nothing is measured, {DEFAULT_STARTUP_S:g} "
                   "unless given.")
@click.option("--startup-timeout", type=click.FloatRange(1), default=600.0, show_default=True,
              help="With --model: seconds the worker gets to become ready.")
@click.option("--gpus-per-replica", type=click.IntRange(1), default=1, show_default=True)
@click.option("--source", default=None, help="The profile's `source` text (default: model, device, dtype, date).")
@click.option("--kv-cache-bytes", type=click.IntRange(1), default=None, help="With --model: the worker's KV budget.")
@click.option("--gpu-memory-utilization", "memory_utilization", type=click.FloatRange(0, 1, min_open=True),
              default=None, help="With --model: passed to the worker.")
@click.option("--max-num-seqs", type=click.IntRange(1), default=None, help="With --model: passed to the worker.")
@click.option("--max-num-batched-tokens", type=click.IntRange(1), default=None,
              help="With --model: passed to the worker.")
@click.option("--block-size", type=click.IntRange(1), default=None, help="With --model: passed to the worker.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="With --model: where the worker's log goes (default: a temporary folder, removed after a "
                   "measurement, kept when it fails).")
@click.option("--control-token-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              envvar=control_token.ENV_TOKEN_FILE,
              help="With --url: the worker's control token file (or $TANDEM_CONTROL_TOKEN). With --model a fresh "
                   f"token is made for the worker. [env: {control_token.ENV_TOKEN_FILE}]")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random prompts.")
def command(model: str | None, url: str | None, device: str, dtype: str, family: str, out_path: Path,
            prompt_lengths: list[int], batch_sizes: list[int], contexts: list[int], decode_tokens: int, repeats: int,
            fit_context: int | None, startup_s: float | None, startup_timeout: float, gpus_per_replica: int,
            source: str | None, kv_cache_bytes: int | None, memory_utilization: float | None,
            max_num_seqs: int | None, max_num_batched_tokens: int | None, block_size: int | None,
            log_dir: Path | None, control_token_file: Path | None, seed: int) -> None:
    """Measure one worker into a capacity profile for `tandem plan --profile`.

    Prefill tokens/s against prompt length and batch, decode ITL against batch and context, KV
    capacity and (with --model) startup time, through the worker's control API."""
    if model is not None and url is not None:
        raise click.UsageError("give --model (start a worker and measure it) or --url (measure a running one), not both")
    if model is None and url is None:
        raise click.UsageError("give --model DIR|tiny (start a worker and measure it) or --url URL (measure a running "
                               "worker)")
    params = dict(click.get_current_context().params)
    bounds = Bounds(prompt_lengths, batch_sizes, contexts, decode_tokens, repeats)

    def say(line: str) -> None:
        click.echo(f"[tandem profile] {line}", err=True)

    def on_sigterm(_signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(143)  # through the finally below: the worker this started is stopped

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    worker: StartedWorker | None = None
    host, gpus = _host(), _gpus()
    meta: dict[str, Any] = {"tool": "tandem profile", "tandem_version": _version(), "command": _command_line(params),
                            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                            "host": host, "gpus": gpus, "bounds": {k: v for k, v in vars(bounds).items()}}
    started = time.monotonic()
    try:
        if model is not None:
            worker, headers, details = _start(model, family, device, dtype, kv_cache_bytes, memory_utilization,
                                              max_num_seqs, max_num_batched_tokens, block_size, log_dir,
                                              startup_timeout, say)
            meta.update(details)
            target = worker.url
            say(f"worker ready after {worker.startup_s:.2f} s (process start to /ready)")
            startup = {"seconds": worker.startup_s if startup_s is None else startup_s, "measured_s": worker.startup_s,
                       "how": "process start of `tandem worker` to its first 200 on /ready (weights loaded, KV "
                              "allocated), on this machine; a pod adds scheduling, image pull and model download"
                              + ("; the profile's startup_s is --startup-s" if startup_s is not None else "")}
        else:
            assert url is not None
            target = url if "://" in url else f"http://{url}"
            headers = _url_headers(control_token_file)
            meta.update({"model": None, "device": "unknown (measured over --url)", "dtype": "unknown (measured over --url)"})
            startup = {"seconds": DEFAULT_STARTUP_S if startup_s is None else startup_s, "measured_s": None,
                       "how": ("not measured (--url: the worker already ran); " +
                               (f"--startup-s {startup_s:g}" if startup_s is not None
                                else f"the Profile default of {DEFAULT_STARTUP_S:g} s"))}
        measured = asyncio.run(_measure(target, headers, bounds, say, seed))
    except ProfileError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        if worker is not None:
            say("stopping the worker")
            worker.stop()
        signal.signal(signal.SIGTERM, previous)
    if worker is not None and log_dir is None:  # measured: the temporary folder (log, token file) goes
        shutil.rmtree(worker.log_path.parent, ignore_errors=True)
    info = measured["info"]
    meta["model"] = meta.get("model") or {"name": info.get("model")}
    meta["worker"] = {k: info.get(k) for k in ("model", "role", "api_version", "layout_hash", "max_model_len",
                                               "block_size", "transport")}
    meta["url"] = target if model is None else None
    meta["duration_s"] = round(time.monotonic() - started, 1)
    with contextlib.suppress(OSError):  # how busy the machine was (1, 5, 15 min), the worker and this included
        meta["host"]["load_average_at_end"] = [round(v, 2) for v in os.getloadavg()]
    device_text = _describe_device(str(meta.get("device", "")), gpus, host) if model is not None else "a worker at " + target
    notes = meta.setdefault("notes", [])
    if str(meta.get("device", "")).startswith("cpu"):
        notes.append(f"CPU figures are this machine's ({host.get('cpus_usable', host.get('cpu_count'))} CPU cores of "
                     f"{host.get('cpu')}, which other processes may share) and noisy: the client, the worker and "
                     f"anything else running compete for the same cores")
    if model is None:
        notes.append("startup_s was not measured (--url)")
    model_name = (meta["model"] or {}).get("name") or info.get("model")
    text = source or (f"tandem profile {meta['date'][:10]}: {model_name} on {device_text}"
                      + (f", {meta['dtype']}" if model is not None else ""))
    try:
        fields, measurements = build_profile(measured, startup, fit_context, text, gpus_per_replica)
    except CapacityError as exc:
        raise click.ClickException(f"the measurements do not make a profile: {exc}") from None
    document = {**fields, "metadata": meta, "measurements": measurements}
    rendered = json.dumps(document, indent=1) + "\n"
    if str(out_path) == "-":
        click.echo(rendered, nl=False)
    else:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(rendered)
        say(f"wrote {out_path}")
    say(f"prefill {fields['prefill_tps']:.0f} tok/s, KV {fields['kv_tokens']:.0f} tokens, ITL "
        f"{fields['itl_base_s'] * 1000:.2f} ms + {fields['itl_per_seq_s'] * 1000:.3f} ms/request, startup "
        f"{fields['startup_s']:.1f} s" + ("" if startup["measured_s"] is not None else " (not measured)"))
    for line in measured["skipped"]:
        say(f"skipped: {line}")


def _start(model: str, family: str, device: str, dtype: str, kv_cache_bytes: int | None,
           memory_utilization: float | None, max_num_seqs: int | None, max_num_batched_tokens: int | None,
           block_size: int | None, log_dir: Path | None, startup_timeout: float,
           say: Callable[[str], None]) -> tuple[StartedWorker, dict[str, str], dict[str, Any]]:
    from tandem.worker.hardware import choose

    folder, served = _resolve_model(model, family)
    try:
        choice = choose(device, dtype, folder)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    logs = log_dir or Path(tempfile.mkdtemp(prefix="tandem-profile-"))
    logs.mkdir(parents=True, exist_ok=True)
    tokens = ControlTokens((control_token.generate(),), "a fresh token for this profile")
    token_file = control_token.write_private(logs / "control-token", tokens.tokens[0])
    tail = ["--role", "both", "--model", str(folder), "--model-name", served, "--device", choice.device,
            "--dtype", choice.dtype, "--control-token-file", str(token_file)]
    for flag, value in (("--kv-cache-bytes", kv_cache_bytes), ("--gpu-memory-utilization", memory_utilization),
                        ("--max-num-seqs", max_num_seqs), ("--max-num-batched-tokens", max_num_batched_tokens),
                        ("--block-size", block_size)):
        if value is not None:
            tail += [flag, str(value)]
    say(f"starting a worker: {served} ({folder}) on {choice.describe()}; its log: {logs / 'worker.log'}")
    # The token file is named on the command line, never the token; no TANDEM_CONTROL_TOKEN reaches the worker.
    env = {control_token.ENV_TOKEN: "", control_token.ENV_TOKEN_FILE: str(token_file)}
    worker = start_worker(tail, logs / "worker.log", startup_timeout, say, env)
    config: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((folder / "config.json").read_text())
    shape = {k: config.get(k) for k in ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "num_key_value_heads", "vocab_size") if k in config}
    what: dict[str, str] = {"what": "tandem's tiny random-weight model (tandem.worker.model.tiny)"} if model == "tiny" else {}
    details: dict[str, Any] = {
        "model": {"name": served, "folder": str(folder), **what, **shape},
        "device": choice.device, "dtype": choice.dtype, "device_choice": choice.why,
        "worker_command": shlex.join(["tandem", *worker.argv[worker.argv.index("worker"):]])}
    return worker, tokens.headers, details


def _url_headers(token_file: Path | None) -> dict[str, str]:
    try:
        tokens = control_token.load(token_file)
    except ControlTokenError as exc:
        raise click.UsageError(str(exc)) from None
    return tokens.headers if tokens is not None else {}


async def _measure(url: str, headers: dict[str, str], bounds: Bounds, say: Callable[[str], None],
                   seed: int) -> dict[str, Any]:
    client = WorkerClient(url, headers, max(bounds.batch_sizes))
    try:
        return await Profiler(client, bounds, say, seed).run()
    finally:
        await client.close()
