"""Human (rich table) and machine (JSON) output of a benchmark summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tandem.worker.bench.client import RequestResult
from tandem.worker.bench.stats import PERCENTILES, Summary


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def table(summary: Summary, title: str) -> Table:
    t = Table(title=title)
    t.add_column("metric")
    for q in PERCENTILES:
        t.add_column(f"p{q} (ms)", justify="right")
    t.add_column("mean (ms)", justify="right")
    for name, d in (("TTFT", summary.ttft_s), ("ITL", summary.itl_s), ("end-to-end", summary.e2e_s)):
        t.add_row(name, *(_ms(d[f"p{q}"]) for q in PERCENTILES), _ms(d["mean"]))
    return t


def print_summary(console: Console, summary: Summary, title: str, notes: list[str]) -> None:
    console.print(table(summary, title))
    console.print(f"requests: {summary.completed} completed, {summary.failed} failed, "
                  f"in {summary.duration_s:.1f}s")
    console.print(f"throughput: {summary.request_throughput:.2f} req/s, "
                  f"{summary.output_throughput:.1f} output tokens/s "
                  f"({summary.prompt_tokens} prompt, {summary.output_tokens} output tokens)")
    if summary.goodput is not None:
        slos = []
        if summary.slo_ttft_s is not None:
            slos.append(f"TTFT <= {summary.slo_ttft_s * 1000:.0f} ms")
        if summary.slo_itl_s is not None:
            slos.append(f"mean ITL <= {summary.slo_itl_s * 1000:.0f} ms")
        console.print(f"goodput: {summary.goodput:.2f} req/s meeting {' and '.join(slos)} "
                      f"({(summary.slo_attainment or 0) * 100:.0f}% of requests)")
    for err in summary.errors:
        console.print(f"[red]error:[/red] {err}")
    for note in notes:
        console.print(f"note: {note}")


def write_json(path: Path, summary: Summary, config: dict[str, Any], notes: list[str]) -> None:
    path.write_text(json.dumps({"config": config, "notes": notes, "summary": summary.as_dict()}, indent=2))


def overall_failure(results: list[RequestResult], planned: int) -> str | None:
    """Why the run as a whole failed (`tandem bench` then exits 1), or None when a request completed.

    Some failed requests are a result worth reporting (exit 0, the failed count is in the summary);
    none completed means the numbers measure nothing, so the exit status says so.
    """
    if any(r.ok for r in results):
        return None
    if not results:
        return f"none of the {planned} requests was sent (their send times were past --max-duration)"
    first = next((r.error for r in results if r.error), "no error message")
    return f"all {len(results)} requests failed; the first error: {first}"


def cell(value: Any, spec: str = "") -> str:
    """One table cell: `spec` applied to a number, "-" for a value that was not measured (None, NaN)."""
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def text_table(columns: list[tuple[str, str, str]], rows: list[dict[str, Any]]) -> str:
    """A plain-text table: columns are (header, key, format spec); a row missing a key shows "-".

    A starved mode (no decode gap measured, no request finished) has None where a figure would be;
    it must print as a row of dashes with its counts, not stop the report.
    """
    body = [[cell(row.get(key), spec) for _, key, spec in columns] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in body)]) for i, (h, _, _) in enumerate(columns)]

    def line(cells: list[str]) -> str:  # the first column (the row's name) left-aligned, figures right
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    return "\n".join(line(r) for r in [[h for h, _, _ in columns], *body])
