"""Fetch a model folder from a tar archive over http(s): what `tandem fetch-model` runs.

A worker pod whose DisaggregatedModel has `spec.model.source.uri` runs this in an init container
that fills the pod's emptyDir. The download is hashed as it streams (and checked against the
expected SHA-256 when one is given; without one, an https URL may not be redirected to plain
http) into a work folder beside the destination; the archive is unpacked there with tarfile's
"data" filter after our own check of every member (no absolute paths, nothing and no link that
leads outside); the folder holding config.json (the top of the archive or one top-level folder) is
then renamed to the destination. So the destination either holds a whole model or does not exist,
and a failed fetch leaves nothing behind.

No torch here: the init container should start in well under a second.
"""

from __future__ import annotations

import gzip
import hashlib
import lzma
import os
import posixpath
import shutil
import tarfile
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

CHUNK_BYTES = 1 << 20
CONNECT_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 300.0  # between two chunks, not for the whole download
WORK_PREFIX = ".{name}.fetch-"  # work folders beside the destination; stale ones are removed on start

# Called with (bytes received so far, total bytes or None when the server does not say).
OnProgress = Callable[[int, int | None], None]


class FetchError(Exception):
    """A fetch that failed, with a one-line message for the user."""


@dataclass(frozen=True)
class FetchResult:
    path: Path
    skipped: bool  # the destination already held a model (a restarted container keeps its emptyDir)
    size_bytes: int = 0
    sha256: str | None = None
    seconds: float = 0.0


def display_url(uri: str) -> str:
    """The URL for messages: without user:password@ and without the query (a presigned URL's signature)."""
    parts = urlsplit(uri)
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    shown = urlunsplit((parts.scheme, host, parts.path, "", ""))
    return shown + ("?..." if parts.query else "")


def fetch_model(uri: str, dest: str | os.PathLike[str], sha256: str | None = None,
                on_progress: OnProgress | None = None, max_bytes: int | None = None) -> FetchResult:
    """Download the tar archive at `uri` and install the model folder in it as `dest`.

    Skips everything when dest/config.json exists. With `max_bytes` (the size of the volume dest is on: the
    operator's emptyDir sizeLimit) the archive and its unpacked files together, which share that volume while
    unpacking, may take at most that much: a larger download, or an archive that unpacks to more, is refused
    before it gets there. Raises FetchError with a one-line message.
    """
    target = Path(dest).absolute()
    if (target / "config.json").is_file():
        return FetchResult(path=target, skipped=True)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FetchError(f"{target} exists but holds no config.json; remove it or choose another --dest")
    if urlsplit(uri).scheme not in ("http", "https"):
        raise FetchError(f"{display_url(uri)} is not an http:// or https:// URL")
    expected = sha256.lower() if sha256 else None

    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = WORK_PREFIX.format(name=target.name)
    for stale in target.parent.glob(f"{prefix}*"):  # left by a fetch that was killed
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    started = time.monotonic()
    try:
        archive = work / "archive"
        # Without a checksum only TLS vouches for the archive: an https URL must not be redirected to plain http.
        https_only = expected is None and urlsplit(uri).scheme == "https"
        size, digest = _download(uri, archive, on_progress, https_only, max_bytes)
        if expected is not None and digest != expected:
            raise FetchError(f"checksum mismatch for {display_url(uri)}: expected sha256 {expected}, got {digest}")
        unpacked = work / "unpacked"
        _extract(archive, unpacked, uri, max_bytes, size)
        archive.unlink()
        _install(_model_folder(unpacked), target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return FetchResult(path=target, skipped=False, size_bytes=size, sha256=digest,
                       seconds=time.monotonic() - started)


def _download(uri: str, path: Path, on_progress: OnProgress | None, https_only: bool = False,
              max_bytes: int | None = None) -> tuple[int, str]:
    """Stream `uri` into `path`, hashing as it goes; returns (bytes, sha256 hex). With `https_only`, a redirect
    through plain http is refused before the body is read; past `max_bytes`, the download is refused (at once
    when the server announces a larger length)."""
    shown = display_url(uri)
    hasher = hashlib.sha256()
    received = 0
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    # identity: the bytes hashed are the file as the server stores it, not a gzip of it made on the fly.
    headers = {"Accept-Encoding": "identity"}
    try:
        with httpx.Client(follow_redirects=True, timeout=timeout, headers=headers) as client, \
                client.stream("GET", uri) as response:
            plain = [hop.url for hop in (*response.history, response) if hop.url.scheme != "https"]
            if https_only and plain:
                raise FetchError(f"{shown} was redirected to plain http ({display_url(str(plain[0]))}), where anyone "
                                 "on the path can replace the archive; refused without --sha256")
            if response.status_code >= 400:
                raise FetchError(f"HTTP {response.status_code} {response.reason_phrase} from {shown}".rstrip())
            length = response.headers.get("content-length")
            total = int(length) if length and length.isdigit() and "content-encoding" not in response.headers \
                else None
            if max_bytes is not None and total is not None and total > max_bytes:
                raise FetchError(f"{shown} is {_size(total)}, more than {_limit(max_bytes)}")
            if on_progress is not None:
                on_progress(0, total)
            with path.open("wb") as out:
                for chunk in response.iter_bytes(CHUNK_BYTES):
                    out.write(chunk)
                    hasher.update(chunk)
                    received += len(chunk)
                    if max_bytes is not None and received > max_bytes:
                        raise FetchError(f"{shown} is larger than {_limit(max_bytes)}: refused after {_size(received)}")
                    if on_progress is not None:
                        on_progress(received, total)
    except httpx.TimeoutException as exc:
        raise FetchError(f"timed out downloading {shown} ({type(exc).__name__}) after {received} bytes") from exc
    except httpx.ConnectError as exc:
        raise FetchError(f"cannot connect to {shown}: {exc}") from exc
    except httpx.HTTPError as exc:  # protocol errors, a connection dropped mid-body, bad URLs
        raise FetchError(f"download of {shown} failed after {received} bytes: {exc}") from exc
    except OSError as exc:  # writing the download: a full or read-only volume
        raise FetchError(f"cannot write the download of {shown} to {path.parent}: {exc}") from exc
    return received, hasher.hexdigest()


def _escapes(name: str) -> bool:
    normal = posixpath.normpath(name)
    return normal == ".." or normal.startswith("../")


def _check_member(member: tarfile.TarInfo) -> None:
    """Refuse what could write outside the work folder (tarfile's data filter checks again)."""
    name = member.name
    if name.startswith("/") or _escapes(name):
        raise FetchError(f"archive member {name!r} would land outside the model folder; refusing the archive")
    if member.issym():
        target = member.linkname
        if target.startswith("/") or _escapes(posixpath.join(posixpath.dirname(name), target)):
            raise FetchError(f"archive member {name!r} links outside the model folder (to {target!r}); "
                             "refusing the archive")
    elif member.islnk() and (member.linkname.startswith("/") or _escapes(member.linkname)):
        raise FetchError(f"archive member {name!r} links outside the model folder (to {member.linkname!r}); "
                         "refusing the archive")


def _checked(tar: tarfile.TarFile, uri: str, max_bytes: int | None, archive_bytes: int) -> Iterator[tarfile.TarInfo]:
    """The members, each checked before it is written. With `max_bytes`, the files written so far and the
    archive beside them (deleted only once all is unpacked) may take at most that much."""
    unpacked = 0
    for member in tar:  # one pass: a large .tar.gz is decompressed once
        _check_member(member)
        if max_bytes is not None and member.isreg():
            unpacked += member.size
            if archive_bytes + unpacked > max_bytes:
                raise FetchError(f"{display_url(uri)} unpacks to more than {_limit(max_bytes)} (the "
                                 f"{_size(archive_bytes)} archive and over {_size(unpacked)} of files, which share "
                                 "the volume while unpacking); refusing the archive")
        yield member


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _limit(max_bytes: int) -> str:
    return f"the {_size(max_bytes)} the model may take (--max-bytes {max_bytes})"


def _extract(archive: Path, into: Path, uri: str, max_bytes: int | None = None, archive_bytes: int = 0) -> None:
    into.mkdir()
    try:
        with _open_tar(archive, uri) as tar:
            tar.extractall(into, members=_checked(tar, uri, max_bytes, archive_bytes), filter="data")
    except tarfile.FilterError as exc:
        raise FetchError(f"unsafe archive member, refusing the archive: {exc}") from exc
    except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile) as exc:
        raise FetchError(f"{display_url(uri)} is a damaged tar archive: {_one_line(exc)}") from exc
    except OSError as exc:  # bz2's bad data, a full disk
        raise FetchError(f"cannot unpack {display_url(uri)}: {_one_line(exc)}") from exc


def _open_tar(archive: Path, uri: str) -> tarfile.TarFile:
    try:
        return tarfile.open(archive, "r:*")  # the caller's with closes it
    except tarfile.ReadError as exc:
        raise FetchError(f"{display_url(uri)} is not a tar archive (plain, gzip, bzip2 or xz)") from exc


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _model_folder(unpacked: Path) -> Path:
    """The folder holding config.json: the top of the archive or its one top-level folder that has one."""
    if (unpacked / "config.json").is_file():
        return unpacked
    found = sorted(d for d in unpacked.iterdir()
                   if d.is_dir() and not d.is_symlink() and (d / "config.json").is_file())
    if len(found) == 1:
        return found[0]
    if found:
        names = ", ".join(d.name for d in found)
        raise FetchError(f"the archive holds several model folders ({names}); it must hold one")
    raise FetchError("no config.json in the archive (looked at its top and in each top-level folder): "
                     "not a model folder")


def _install(folder: Path, target: Path) -> None:
    try:
        if target.is_dir():
            target.rmdir()  # empty (checked at the start): rename cannot replace a folder
        os.rename(folder, target)
    except OSError as exc:
        raise FetchError(f"cannot move the model folder to {target}: {exc}") from exc
