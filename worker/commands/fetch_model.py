"""`tandem fetch-model --uri URL --dest DIR [--sha256 HEX] [--max-bytes N]`: download and unpack a model folder;
`tandem fetch-model --model org/name[@revision]`: download a Hugging Face Hub model into the Hub cache.

The init container of a worker pod whose model source is a uri runs this (docs/operator.md).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from tandem.worker.model.fetch import FetchError, display_url, fetch_model

LOG_EVERY_S = 10.0


def _check_uri(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise click.BadParameter(f"{value!r} is not an http:// or https:// URL")
    return value


def _check_sha256(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", value):
        raise click.BadParameter("expected 64 hex digits (the output of sha256sum)")
    return value.lower() if value else None


@click.command("fetch-model")
@click.option("--model", "hub_model", default=None, metavar="ORG/NAME[@REVISION]",
              help="A Hugging Face Hub model to download into the Hub cache (HF_HOME / HF_HUB_CACHE; HF_TOKEN for "
                   "gated ones); prints the snapshot folder. Instead of --uri.")
@click.option("--link", default=None, type=click.Path(dir_okay=False),
              help="With --model: also make LINK a symbolic link to the snapshot folder (what a worker pod's "
                   "`tandem worker --model LINK` reads: the commit this fetch resolved, whatever a branch does later).")
@click.option("--uri", default=None, callback=_check_uri,
              help="http(s) URL of a .tar, .tar.gz or .tgz of the model folder (config.json at its top or in "
                   "its one top-level folder).")
@click.option("--dest", default=None, type=click.Path(file_okay=False),
              help="Where the model folder goes; nothing is downloaded when DEST/config.json already exists.")
@click.option("--sha256", default=None, callback=_check_sha256,
              help="Expected SHA-256 of the archive; a download that differs is refused. Without it, an https "
                   "URL may not be redirected to plain http.")
@click.option("--max-bytes", type=click.IntRange(min=1), default=None,
              help="Most bytes the archive and its unpacked files may take together (they share DEST's volume "
                   "while unpacking): a larger archive, or one that unpacks to more, is refused. Default: no limit.")
def command(hub_model: str | None, link: str | None, uri: str | None, dest: str | None, sha256: str | None,
            max_bytes: int | None) -> None:
    """Download a model folder archive, verify it and unpack it into DEST, atomically; or a Hub model (--model)."""
    if (hub_model is None) == (uri is None):
        raise click.UsageError("give one of --uri URL (with --dest) and --model ORG/NAME[@REVISION]")
    if hub_model is not None:
        if dest is not None or sha256 is not None or max_bytes is not None:
            raise click.UsageError("--dest, --sha256 and --max-bytes go with --uri; a --model download goes to the "
                                   "Hugging Face cache (set HF_HUB_CACHE or HF_HOME to move it)")
        _fetch_hub(hub_model, link)
        return
    if link is not None:
        raise click.UsageError("--link goes with --model")
    if uri is None or dest is None:
        raise click.UsageError("--uri needs --dest DIR")
    console = Console(stderr=True)
    # Started on the first byte only, so a skipped fetch or an HTTP error draws no empty bar.
    progress = Progress(TextColumn("download"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        TimeRemainingColumn(), console=console, disable=not console.is_terminal)
    task = progress.add_task("download", total=None)
    started = time.monotonic()
    last_line = started

    def on_progress(received: int, total: int | None) -> None:
        nonlocal last_line
        if console.is_terminal:
            if not progress.live.is_started:
                progress.start()
            progress.update(task, completed=received, total=total)
            return
        # Not a terminal (kubectl logs): a plain line every LOG_EVERY_S instead of a bar nobody sees.
        if received == 0:
            size = f" ({total / 1e6:.1f} MB)" if total else ""
            click.echo(f"downloading {display_url(uri)}{size}", err=True)
        now = time.monotonic()
        if now - last_line >= LOG_EVERY_S:
            last_line = now
            of = f" of {total / 1e6:.1f} MB ({100 * received / total:.0f}%)" if total else ""
            click.echo(f"downloaded {received / 1e6:.1f} MB{of}, {received / 1e6 / (now - started):.1f} MB/s",
                       err=True)

    def stop_progress() -> None:
        if progress.live.is_started:  # stopping an unstarted Progress still prints a newline
            progress.stop()

    try:
        result = fetch_model(uri, dest, sha256=sha256, on_progress=on_progress, max_bytes=max_bytes)
    except FetchError as exc:
        stop_progress()
        click.echo(f"tandem fetch-model: error: {' '.join(str(exc).split())}", err=True)
        sys.exit(1)
    finally:
        stop_progress()
    if result.skipped:
        click.echo(f"{result.path} already holds a model (config.json is there): skipping the download")
        return
    checked = "verified" if sha256 else "not checked: no --sha256"
    click.echo(f"fetched {display_url(uri)} ({result.size_bytes / 1e6:.1f} MB in {result.seconds:.1f} s, "
               f"sha256 {result.sha256}, {checked}) into {result.path}")


def _fetch_hub(value: str, link: str | None) -> None:
    from tandem.worker.model.hub import HubError, HubModel, describe, download, parse_model

    def say(line: str) -> None:
        click.echo(line, err=True)

    try:
        model = parse_model(value if value.startswith("hf://") else "hf://" + value)
        assert isinstance(model, HubModel)
        say(describe(model))
        folder = download(model, say)
        if link is not None:
            _replace_link(Path(link), folder)
    except HubError as exc:
        click.echo(f"tandem fetch-model: error: {exc}", err=True)
        sys.exit(1)
    click.echo(str(folder))


def _replace_link(link: Path, target: Path) -> None:
    """Point `link` at `target`, atomically (a new link renamed over the old one)."""
    from tandem.worker.model.hub import HubError

    fresh = link.with_name(f".{link.name}.new")
    try:
        link.parent.mkdir(parents=True, exist_ok=True)
        fresh.unlink(missing_ok=True)
        fresh.symlink_to(target.resolve(), target_is_directory=True)
        os.replace(fresh, link)
    except OSError as exc:
        raise HubError(f"cannot link {link} to {target}: {exc}") from exc
