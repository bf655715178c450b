"""`tandem fetch-model` (the init container of a uri model source), for real: a tiny model served as a tar
archive by an HTTP server on 127.0.0.1, fetched by the `tandem` command in a subprocess."""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import socket
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tandem.worker.model.fetch import display_url


@dataclass
class Server:
    """Serves the files of `root`; /truncated/<file> announces the whole file but sends half of it;
    /nolength/<file> sends the whole file without a Content-Length (the end is the connection's close)."""

    root: Path
    url: str
    requests: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tandem.worker.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("src") / "tiny-llama")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("www")
    served: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(root), **kwargs)  # type: ignore[arg-type]

        def do_GET(self) -> None:
            served.append(self.path)
            if self.path.startswith("/truncated/"):
                body = (root / self.path.removeprefix("/truncated/")).read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            if self.path.startswith("/nolength/"):
                body = (root / self.path.removeprefix("/nolength/")).read_bytes()
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True
                return
            super().do_GET()

        def log_message(self, format: str, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield Server(root, f"http://127.0.0.1:{httpd.server_address[1]}", served)
    finally:
        httpd.shutdown()
        httpd.server_close()


def fetch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tandem.worker.cli", "fetch-model", *args],
                          capture_output=True, text=True, timeout=120)


def pack(server: Server, name: str, model: Path, mode: str = "w:gz", folder: str | None = "tiny-llama") -> str:
    """Archive the model folder (under `folder`, or at the top when None); returns its sha256."""
    path = server.root / name
    with tarfile.open(path, mode) as tar:
        for file in sorted(model.iterdir()):
            tar.add(file, arcname=f"{folder}/{file.name}" if folder else file.name)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pack_members(server: Server, name: str, members: list[tuple[tarfile.TarInfo, bytes]]) -> None:
    with tarfile.open(server.root / name, "w:gz") as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)


def member(name: str, data: bytes = b"{}", kind: bytes = tarfile.REGTYPE, link: str = "") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info, data if kind == tarfile.REGTYPE else b""


def error(res: subprocess.CompletedProcess[str]) -> str:
    """The one error line, which must be the last thing on stderr (exit code 1)."""
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("tandem fetch-model: error: ")]
    assert errors == lines[-1:], res.stderr
    return errors[0].removeprefix("tandem fetch-model: error: ")


def assert_nothing_left(dest: Path) -> None:
    assert not dest.exists(), sorted(p.name for p in dest.iterdir())
    leftovers = sorted(p.name for p in dest.parent.iterdir()) if dest.parent.exists() else []
    assert leftovers == [], leftovers


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


@pytest.mark.parametrize(("name", "mode", "folder"), [
    ("tiny.tar.gz", "w:gz", "tiny-llama"),
    ("tiny.tgz", "w:gz", None),
    ("tiny.tar", "w", "tiny-llama"),
    ("dot.tgz", "w:gz", "."),  # as `tar czf dot.tgz -C tiny-llama .` writes it
    ("tiny-xz.tar", "w:xz", None),  # the compression comes from the content, not the name
])
def test_fetched_model_is_the_archived_folder_and_loads(server: Server, tiny_model: Path, tmp_path: Path,
                                                        name: str, mode: str, folder: str | None) -> None:
    digest = pack(server, name, tiny_model, mode, folder)
    dest = tmp_path / "models" / "model"
    res = fetch("--uri", f"{server.url}/{name}", "--dest", str(dest), "--sha256", digest)
    assert res.returncode == 0, res.stderr
    assert f"sha256 {digest}, verified" in res.stdout and str(dest) in res.stdout
    # Not a terminal (as in kubectl logs): plain lines instead of a progress bar.
    size_mb = (server.root / name).stat().st_size / 1e6
    assert res.stderr.splitlines()[0] == f"downloading {server.url}/{name} ({size_mb:.1f} MB)"
    assert same_files(tiny_model, dest)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model"]  # no work folder left beside it


def test_fetched_model_loads_with_the_engines_loader(server: Server, tiny_model: Path, tmp_path: Path) -> None:
    import torch

    from tandem.worker.model.loader import load_model

    pack(server, "load.tgz", tiny_model)
    dest = tmp_path / "model"
    res = fetch("--uri", f"{server.url}/load.tgz", "--dest", str(dest))  # no --sha256: still fetched
    assert res.returncode == 0, res.stderr
    assert "not checked: no --sha256" in res.stdout
    fetched, original = load_model(dest), load_model(tiny_model)
    for (name, a), (_, b) in zip(fetched.state_dict().items(), original.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_model_already_there_is_not_downloaded_again(server: Server, tiny_model: Path, tmp_path: Path) -> None:
    pack(server, "again.tgz", tiny_model)
    dest = tmp_path / "model"
    assert fetch("--uri", f"{server.url}/again.tgz", "--dest", str(dest)).returncode == 0
    before = len(server.requests)
    (dest / "marker").write_text("kept")
    res = fetch("--uri", f"{server.url}/again.tgz", "--dest", str(dest), "--sha256", "0" * 64)
    assert res.returncode == 0, res.stderr
    assert "already holds a model" in res.stdout and "skipping the download" in res.stdout
    assert len(server.requests) == before  # not even a request
    assert (dest / "marker").read_text() == "kept"


def test_http_error_names_the_status_and_url(server: Server, tmp_path: Path) -> None:
    dest = tmp_path / "models" / "model"
    res = fetch("--uri", f"{server.url}/missing.tgz", "--dest", str(dest))
    assert error(res) == f"HTTP 404 File not found from {server.url}/missing.tgz"
    assert res.stderr.count("\n") == 1  # nothing else: no empty progress bar
    assert_nothing_left(dest)


def test_connection_refused(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = fetch("--uri", f"http://127.0.0.1:{port}/m.tgz", "--dest", str(tmp_path / "m" / "model"))
    assert error(res).startswith(f"cannot connect to http://127.0.0.1:{port}/m.tgz: ")


def test_checksum_mismatch_says_expected_and_got(server: Server, tiny_model: Path, tmp_path: Path) -> None:
    digest = pack(server, "sum.tgz", tiny_model)
    wrong = "F" * 64  # upper case is accepted on the command line
    dest = tmp_path / "models" / "model"
    res = fetch("--uri", f"{server.url}/sum.tgz", "--dest", str(dest), "--sha256", wrong)
    assert error(res) == f"checksum mismatch for {server.url}/sum.tgz: expected sha256 {'f' * 64}, got {digest}"
    assert_nothing_left(dest)


def test_download_cut_short_fails(server: Server, tiny_model: Path, tmp_path: Path) -> None:
    pack(server, "cut.tgz", tiny_model)
    dest = tmp_path / "models" / "model"
    res = fetch("--uri", f"{server.url}/truncated/cut.tgz", "--dest", str(dest))
    assert error(res).startswith(f"download of {server.url}/truncated/cut.tgz failed after ")
    assert_nothing_left(dest)


@pytest.mark.parametrize(("content", "expected"), [
    ("garbage", "is not a tar archive (plain, gzip, bzip2 or xz)"),
    ("truncated-gzip", "is a damaged tar archive"),
])
def test_corrupt_archive_is_refused(server: Server, tiny_model: Path, tmp_path: Path, content: str,
                                    expected: str) -> None:
    if content == "garbage":
        (server.root / "bad.tgz").write_bytes(b"this is not a tar archive\n" * 100)
    else:
        pack(server, "whole.tgz", tiny_model)
        whole = (server.root / "whole.tgz").read_bytes()
        (server.root / "bad.tgz").write_bytes(whole[: len(whole) // 2])
    dest = tmp_path / "models" / "model"
    res = fetch("--uri", f"{server.url}/bad.tgz", "--dest", str(dest))
    assert error(res).startswith(f"{server.url}/bad.tgz {expected}")
    assert_nothing_left(dest)


@pytest.mark.parametrize(("members", "expected"), [
    ([member("tiny/tokenizer.json")], "no config.json in the archive"),
    ([member("a/config.json"), member("b/config.json")], "several model folders (a, b)"),
    ([member("deep/er/config.json")], "no config.json in the archive"),
])
def test_archive_without_one_model_folder_is_refused(server: Server, tmp_path: Path,
                                                     members: list[tuple[tarfile.TarInfo, bytes]],
                                                     expected: str) -> None:
    pack_members(server, "nomodel.tgz", members)
    dest = tmp_path / "models" / "model"
    res = fetch("--uri", f"{server.url}/nomodel.tgz", "--dest", str(dest))
    assert expected in error(res)
    assert_nothing_left(dest)


@pytest.mark.parametrize(("evil", "expected"), [
    (member("../escaped.txt"), "'../escaped.txt' would land outside"),
    (member("tiny/../../escaped.txt"), "would land outside"),
    (member("/tmp/tandem-fetch-absolute.txt"), "would land outside"),
    (member("tiny/passwd", kind=tarfile.SYMTYPE, link="/etc/passwd"), "links outside the model folder (to '/etc/passwd')"),
    (member("tiny/up", kind=tarfile.SYMTYPE, link="../../escaped.txt"), "links outside"),
    (member("tiny/hard", kind=tarfile.LNKTYPE, link="../escaped.txt"), "links outside"),
    (member("tiny/dev", kind=tarfile.CHRTYPE), "unsafe archive member"),  # tarfile's data filter
])
def test_members_that_escape_are_refused(server: Server, tmp_path: Path, evil: tuple[tarfile.TarInfo, bytes],
                                         expected: str) -> None:
    pack_members(server, "evil.tgz", [member("tiny/config.json"), evil])
    dest = tmp_path / "models" / "model"
    res = fetch("--uri", f"{server.url}/evil.tgz", "--dest", str(dest))
    assert expected in error(res)
    assert_nothing_left(dest)
    assert not (tmp_path / "escaped.txt").exists() and not Path("/tmp/tandem-fetch-absolute.txt").exists()


def test_a_work_folder_left_by_a_killed_fetch_is_removed(server: Server, tiny_model: Path, tmp_path: Path) -> None:
    pack(server, "stale.tgz", tiny_model)
    stale = tmp_path / ".model.fetch-old"
    (stale / "unpacked").mkdir(parents=True)
    (stale / "archive").write_bytes(b"half a download")
    res = fetch("--uri", f"{server.url}/stale.tgz", "--dest", str(tmp_path / "model"))
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_non_empty_destination_without_a_model_is_left_alone(server: Server, tiny_model: Path,
                                                               tmp_path: Path) -> None:
    pack(server, "busy.tgz", tiny_model)
    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    res = fetch("--uri", f"{server.url}/busy.tgz", "--dest", str(dest))
    assert error(res) == f"{dest} exists but holds no config.json; remove it or choose another --dest"
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize(("args", "expected"), [
    (["--uri", "ftp://models.example/m.tgz"], "not an http:// or https:// URL"),
    (["--uri", "http://x/m.tgz", "--sha256", "abc"], "expected 64 hex digits"),
    (["--uri", "http://x/m.tgz", "--max-bytes", "0"], "--max-bytes"),
])
def test_bad_arguments_are_usage_errors(tmp_path: Path, args: list[str], expected: str) -> None:
    res = fetch(*args, "--dest", str(tmp_path / "model"))
    assert res.returncode == 2 and expected in res.stderr, res.stderr


@pytest.mark.parametrize(("uri", "shown"), [
    ("https://user:secret@models.example:8443/m.tgz?X-Amz-Signature=abc", "https://models.example:8443/m.tgz?..."),
    ("http://models.example/a/b.tar", "http://models.example/a/b.tar"),
    ("http://[::1]:8080/m.tgz", "http://[::1]:8080/m.tgz"),
])
def test_messages_hide_credentials_and_signatures(uri: str, shown: str) -> None:
    assert display_url(uri) == shown


# --- https: without a checksum, TLS is what vouches for the archive, so no redirect may lead to plain http ---


@pytest.fixture(scope="module")
def tls_server(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """An https server on 127.0.0.1 (a self-signed certificate, trusted through SSL_CERT_FILE) serving the same
    files as `server`; /to-http/<file> redirects to <file> on the plain http server. Yields (url, certificate)."""
    import ssl

    work = tmp_path_factory.mktemp("tls")
    cert, key = work / "cert.pem", work / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(server.root), **kwargs)  # type: ignore[arg-type]

        def do_GET(self) -> None:
            if self.path.startswith("/to-http/"):
                self.send_response(302)
                self.send_header("Location", f"{server.url}/{self.path.removeprefix('/to-http/')}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, format: str, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{httpd.server_address[1]}", cert
    finally:
        httpd.shutdown()
        httpd.server_close()


def fetch_trusting(cert: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SSL_CERT_FILE": str(cert)}
    return subprocess.run([sys.executable, "-m", "tandem.worker.cli", "fetch-model", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_https_without_a_checksum_is_fetched(server: Server, tls_server: tuple[str, Path], tiny_model: Path,
                                             tmp_path: Path) -> None:
    url, cert = tls_server
    pack(server, "tls.tgz", tiny_model)
    dest = tmp_path / "models" / "model"
    res = fetch_trusting(cert, "--uri", f"{url}/tls.tgz", "--dest", str(dest))
    assert res.returncode == 0, res.stderr
    assert same_files(tiny_model, dest)


def test_an_https_uri_redirected_to_plain_http_is_refused_without_a_checksum(
        server: Server, tls_server: tuple[str, Path], tiny_model: Path, tmp_path: Path) -> None:
    url, cert = tls_server
    digest = pack(server, "down.tgz", tiny_model)
    dest = tmp_path / "models" / "model"
    res = fetch_trusting(cert, "--uri", f"{url}/to-http/down.tgz", "--dest", str(dest))
    assert error(res) == (f"{url}/to-http/down.tgz was redirected to plain http ({server.url}/down.tgz), where "
                          "anyone on the path can replace the archive; refused without --sha256")
    assert_nothing_left(dest)
    # With the checksum the bytes are checked, whoever carried them.
    res = fetch_trusting(cert, "--uri", f"{url}/to-http/down.tgz", "--dest", str(dest), "--sha256", digest)
    assert res.returncode == 0, res.stderr
    assert f"sha256 {digest}, verified" in res.stdout and same_files(tiny_model, dest)


# --- --max-bytes: the emptyDir's sizeLimit, which the archive and its unpacked files share while unpacking ---


def test_an_archive_larger_than_max_bytes_is_refused_before_its_body_is_read(server: Server, tiny_model: Path,
                                                                             tmp_path: Path) -> None:
    pack(server, "big.tgz", tiny_model)
    size = (server.root / "big.tgz").stat().st_size
    dest = tmp_path / "models" / "model"
    res = fetch("--uri", f"{server.url}/big.tgz", "--dest", str(dest), "--max-bytes", str(size - 1))
    message = error(res)
    assert message.startswith(f"{server.url}/big.tgz is ") and f"(--max-bytes {size - 1})" in message, message
    assert res.stderr.count("\n") == 1  # refused on the announced length: no "downloading" line
    assert_nothing_left(dest)


def test_a_download_without_a_length_is_cut_at_max_bytes(server: Server, tiny_model: Path, tmp_path: Path) -> None:
    pack(server, "unannounced.tgz", tiny_model)
    size = (server.root / "unannounced.tgz").stat().st_size
    dest = tmp_path / "models" / "model"
    res = fetch("--uri", f"{server.url}/nolength/unannounced.tgz", "--dest", str(dest), "--max-bytes", str(size // 2))
    message = error(res)
    assert message.startswith(f"{server.url}/nolength/unannounced.tgz is larger than the ") and \
        f"(--max-bytes {size // 2}): refused after " in message, message
    assert_nothing_left(dest)


def test_an_archive_that_unpacks_past_max_bytes_is_refused_while_unpacking(server: Server, tmp_path: Path) -> None:
    # 8 MiB of zeros gzip to a few KiB: the download fits, the files do not.
    pack_members(server, "bomb.tgz", [member("m/config.json"), member("m/zeros.safetensors", bytes(8 << 20))])
    archive = (server.root / "bomb.tgz").stat().st_size
    assert archive < 64 << 10
    dest = tmp_path / "models" / "model"
    res = fetch("--uri", f"{server.url}/bomb.tgz", "--dest", str(dest), "--max-bytes", str(1 << 20))
    message = error(res)
    assert message.startswith(f"{server.url}/bomb.tgz unpacks to more than the 1.0 MiB the model may take "
                              f"(--max-bytes {1 << 20})") and message.endswith("refusing the archive"), message
    assert_nothing_left(dest)


def test_a_model_that_fits_max_bytes_with_its_archive_is_fetched(server: Server, tiny_model: Path,
                                                                 tmp_path: Path) -> None:
    pack(server, "fits.tgz", tiny_model)
    needed = (server.root / "fits.tgz").stat().st_size + sum(p.stat().st_size for p in tiny_model.iterdir())
    dest = tmp_path / "models" / "model"
    assert fetch("--uri", f"{server.url}/fits.tgz", "--dest", str(dest), "--max-bytes", str(needed - 1)).returncode == 1
    assert_nothing_left(dest)
    res = fetch("--uri", f"{server.url}/fits.tgz", "--dest", str(dest), "--max-bytes", str(needed))
    assert res.returncode == 0, res.stderr
    assert same_files(tiny_model, dest)
