"""A STAND-IN for the Hugging Face Hub: there is no Hub reachable here, so the Hub tests point
huggingface_hub at this local HTTP server with HF_ENDPOINT.

It speaks the subset of the Hub's HTTP API that `snapshot_download` uses (huggingface_hub 2.x):

- `GET /api/models/{repo}/revision/{rev}`: the repo info (`sha`, `siblings`);
- `GET /api/models/{repo}/tree/{rev}?recursive=...`: the file listing (`type`, `path`, `size`, `oid`,
  and `lfs` for *.safetensors), one page (no `Link` header);
- `HEAD|GET /{repo}/resolve/{rev}/{file}`: the file, with `X-Repo-Commit`, `ETag` (the git blob id,
  or the sha256 for LFS files, which also get `X-Linked-Etag` / `X-Linked-Size`), `Content-Length`,
  and `Range: bytes=N-` answered 206 with `Content-Range` (how a download resumes).

Errors carry the Hub's `X-Error-Code` headers, which huggingface_hub turns into its exceptions:
an unknown repo is 401 `RepoNotFound` (the Hub does not tell strangers whether a repo exists), an
unknown revision 404 `RevisionNotFound`, a gated repo 401 `GatedRepo` without a token, 401
"Invalid credentials in Authorization header" for a token the Hub does not know, and 403 `GatedRepo`
for a known token without access. Not spoken: Xet storage, CDN redirects, pagination, uploads.

Faults for the tests: `drop_once` cuts the connection halfway through the first GET of a file;
`fail_once` answers 500 to the first GET of a file; `slow` delays every GET of a file.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit hash
    gated: bool = False
    granted_tokens: set[str] = field(default_factory=set)

    @property
    def sha(self) -> str:
        digest = hashlib.sha1()
        for name in sorted(self.files):
            digest.update(name.encode() + b"\0" + self.files[name])
        return digest.hexdigest()

    def resolve(self, revision: str) -> str | None:
        if revision == self.sha:
            return revision
        return {"main": self.sha, **self.refs}.get(revision)


def folder_repo(folder: Path, **kwargs: object) -> Repo:
    """A repo holding the files of a model folder (top level)."""
    return Repo(files={p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}, **kwargs)  # type: ignore[arg-type]


def _is_lfs(name: str) -> bool:
    return name.endswith(".safetensors")


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Logged:
    method: str
    path: str
    range: str | None
    auth: bool


class HubStandIn:
    """`with HubStandIn() as hub:` serves on 127.0.0.1 (or `host`: the real node's pods reach the node IP);
    `hub.url` is the HF_ENDPOINT to use."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.repos: dict[str, Repo] = {}
        self.known_tokens: set[str] = set()
        self.drop_once: set[str] = set()   # file names: cut the connection halfway, on the first GET only
        self.fail_once: set[str] = set()   # file names: HTTP 500 on the first GET only
        self.slow: dict[str, float] = {}   # file names: seconds to wait before answering a GET
        self.log: list[Logged] = []
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer((host, 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def gets(self, name: str) -> list[Logged]:
        """The GETs of a file (downloads, not HEADs)."""
        return [e for e in self.log if e.method == "GET" and "/resolve/" in e.path and e.path.endswith("/" + name)]

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _error(self, status: int, code: str | None = None, message: str | None = None) -> None:
                self.send_response(status)
                if code:
                    self.send_header("X-Error-Code", code)
                if message:
                    self.send_header("X-Error-Message", message)
                payload = json.dumps({"error": message or code or "error"}).encode()
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def _json(self, value: object) -> None:
                payload = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _authorized(self, repo: Repo) -> bool:
                """Answers the error and returns False when the caller may not read `repo`."""
                header = self.headers.get("Authorization", "")
                token = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else None
                if token is not None and token not in hub.known_tokens:
                    self._error(401, message="Invalid credentials in Authorization header")
                    return False
                if not repo.gated or (token is not None and token in repo.granted_tokens):
                    return True
                if token is None:
                    self._error(401, "GatedRepo", "Access to this model is restricted: you must be authenticated.")
                else:
                    self._error(403, "GatedRepo", "Access to this model is restricted: this account has no access.")
                return False

            def _find(self, org: str, name: str) -> tuple[str, Repo] | None:
                repo_id = f"{org}/{name}"
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._error(401, "RepoNotFound", "Repository not found")
                    return None
                return repo_id, repo

            def _serve(self, body: bool) -> None:
                parts = urlsplit(self.path)
                path = unquote(parts.path)
                hub.log.append(Logged(self.command, path, self.headers.get("Range"),
                                      "Authorization" in self.headers))
                segs = path.strip("/").split("/")
                if len(segs) >= 6 and segs[:2] == ["api", "models"] and segs[4] in ("revision", "tree"):
                    found = self._find(segs[2], segs[3])
                    if found is None or not self._authorized(found[1]):
                        return
                    repo_id, repo = found
                    sha = repo.resolve("/".join(segs[5:]))
                    if sha is None:
                        self._error(404, "RevisionNotFound", "Invalid rev id")
                        return
                    if segs[4] == "revision":
                        self._json({"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                                    "gated": "manual" if repo.gated else False,
                                    "siblings": [{"rfilename": n} for n in sorted(repo.files)]})
                    else:
                        self._json([self._entry(n, d) for n, d in sorted(repo.files.items())])
                    return
                if len(segs) >= 5 and segs[2] == "resolve":
                    found = self._find(segs[0], segs[1])
                    if found is None or not self._authorized(found[1]):
                        return
                    repo_id, repo = found
                    sha = repo.resolve(segs[3])
                    if sha is None:
                        self._error(404, "RevisionNotFound", "Invalid rev id")
                        return
                    filename = "/".join(segs[4:])
                    if filename not in repo.files:
                        self._error(404, "EntryNotFound", "Entry not found")
                        return
                    self._file(repo, sha, filename, body)
                    return
                self._error(404, message="not spoken by the stand-in")

            def _entry(self, name: str, data: bytes) -> dict[str, object]:
                entry: dict[str, object] = {"type": "file", "path": name, "size": len(data), "oid": _blob_id(data)}
                if _is_lfs(name):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                return entry

            def _file(self, repo: Repo, sha: str, name: str, body: bool) -> None:
                data = repo.files[name]
                with hub._lock:
                    drop = body and name in hub.drop_once
                    fail = body and name in hub.fail_once
                    if drop:
                        hub.drop_once.discard(name)
                    if fail:
                        hub.fail_once.discard(name)
                if fail:
                    self._error(500, message="Internal Error (stand-in fault)")
                    return
                if body and name in hub.slow:
                    time.sleep(hub.slow[name])
                start = 0
                wanted = self.headers.get("Range")
                if wanted and wanted.startswith("bytes=") and wanted.endswith("-"):
                    start = int(wanted[len("bytes="):-1])
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", sha)
                if _is_lfs(name):
                    etag = hashlib.sha256(data).hexdigest()
                    self.send_header("X-Linked-Etag", f'"{etag}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                else:
                    etag = _blob_id(data)
                self.send_header("ETag", f'"{etag}"')
                self.send_header("Accept-Ranges", "bytes")
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if not body:
                    return
                if drop:  # announce everything, send half, hang up
                    self.wfile.write(data[start:start + (len(data) - start) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data[start:])

        return Handler
