"""Models from the Hugging Face Hub: `--model org/name[@revision]` (or `hf://name[@revision]`).

What a `--model` value means: a folder that exists is always the local folder (a relative path such
as `meta-llama/Llama-3.1-8B` that names a folder in the working directory included); otherwise
`org/name[@revision]` is a Hub repository id; `hf://` forces the Hub (also for a name without an
org, or when a folder of that name exists here). Anything else is a folder that does not exist.

The download goes through `huggingface_hub` into its standard cache (HF_HOME / HF_HUB_CACHE), so
HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE and the cache shared with transformers and vLLM all apply.
Only what the engine reads is fetched, in two steps: the small files first (config, tokenizer,
generation config, chat template, the safetensors index), then the weights, which are the shards the
index names, or else the top-level *.safetensors; so a repository that also carries
`consolidated.safetensors` or `.bin`/`.gguf` copies costs one copy, and one without safetensors is
refused before anything large is downloaded. A dropped connection resumes from the byte where it
broke (huggingface_hub's Range retry); a run that was killed keeps every finished file and
downloads only the rest.

No torch here: `tandem fetch-model` must start fast.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

HUB_PREFIX = "hf://"

# Small files the engine reads (tokenizer.py, config.py, loader.py); exact names, top level only.
SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
)
INDEX_FILE = "model.safetensors.index.json"

# huggingface_hub's own rule for repo ids: [org/]name of letters, digits, - _ . (no -- or ..).
_REPO_PART = r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}"
_REPO_ID = re.compile(rf"(?:{_REPO_PART}/)?{_REPO_PART}")


class HubError(Exception):
    """A Hub download that failed, with a message that says what to do."""


@dataclass(frozen=True)
class HubModel:
    repo: str
    revision: str | None = None  # None: the default branch (main)

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "")


def parse_model(value: str) -> Path | HubModel:
    """What `--model VALUE` names: an existing local folder, else a Hub repository, else a (missing) folder."""
    forced = value.startswith(HUB_PREFIX)
    if not forced:
        folder = Path(value).expanduser()
        if folder.exists():
            return folder
    spec = value.removeprefix(HUB_PREFIX)
    repo, _, revision = spec.partition("@")
    looks_like_repo = _REPO_ID.fullmatch(repo) is not None and ".." not in repo and "--" not in repo
    if forced:
        if not looks_like_repo or ("@" in spec and not revision):
            raise HubError(f"{value!r} is not a Hugging Face repository id: expected hf://[org/]name[@revision]")
        return HubModel(repo, revision or None)
    if looks_like_repo and "/" in repo and not value.startswith(("/", "./", "~")) and ("@" not in spec or revision):
        return HubModel(repo, revision or None)
    return Path(value).expanduser()


def resolve(value: str, log: Callable[[str], None]) -> tuple[Path, str | None]:
    """`--model VALUE` as (local folder, served name or None): a Hub model is downloaded first and served as its
    repository id; a folder is returned as given (the caller checks it holds a model)."""
    model = parse_model(value)
    if isinstance(model, Path):
        return model, None
    log(describe(model))
    return download(model, log), model.repo


def describe(model: HubModel) -> str:
    """The line said before a download: which model, from where, into which cache."""
    if _offline():
        return f"Hub model {model}: from the cache {hub_cache()} (HF_HUB_OFFLINE is set)"
    return f"Hub model {model}: downloading from {_endpoint()} into {hub_cache()} (only missing files)"


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def download(model: HubModel, log: Callable[[str], None] = lambda _: None) -> Path:
    """The local snapshot folder of `model`, downloaded (or completed) first unless HF_HUB_OFFLINE is set.

    Downloads of one repository into one cache take turns (a lock file in the cache, see _download_lock), so
    worker pods sharing a cache volume download it once: the others wait, then find every file there.
    Raises HubError with a message that names the repository and says what to do.
    """
    from huggingface_hub import snapshot_download

    try:
        with contextlib.ExitStack() as stack:
            if not _offline():
                stack.enter_context(_download_lock(model, log))
            folder = Path(snapshot_download(model.repo, revision=model.revision, allow_patterns=list(SMALL_FILES)))
            weights = _weight_files(model, folder)
            # The commit the small files came from, so a branch that moves meanwhile cannot mix two commits.
            folder = Path(snapshot_download(model.repo, revision=folder.name, allow_patterns=weights))
    except HubError:
        raise
    except Exception as exc:  # every failure becomes one message that says what to do
        raise HubError(explain(model, exc)) from exc
    return folder


@contextlib.contextmanager
def _download_lock(model: HubModel, log: Callable[[str], None]) -> Iterator[None]:
    """Hold `<cache>/.tandem-locks/<repo>.lock` (a POSIX record lock: NFS passes those between nodes) while
    downloading; say so when another process holds it. The kernel (or the NFS server's lease) releases the
    lock of a process that dies, so a killed download never blocks the next one."""
    folder = Path(hub_cache()) / ".tandem-locks"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = (folder / (model.repo.replace("/", "--") + ".lock")).open("a+")
    except OSError as exc:
        raise HubError(f"cannot write to the Hub cache {hub_cache()} ({exc.strerror}): make it writable by this "
                       f"user (uid {os.getuid()}, gid {os.getgid()}), or set HF_HUB_CACHE to a folder that is"
                       ) from exc
    with handle:
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            log(f"another download of {model.repo} into {hub_cache()} is under way (lock {handle.name}): waiting "
                "for it to finish")
            fcntl.lockf(handle, fcntl.LOCK_EX)
        yield


def _weight_files(model: HubModel, folder: Path) -> list[str]:
    """The safetensors files to download: the shards the index names, or the top-level *.safetensors."""
    from huggingface_hub import get_cached_repo_tree

    if not (folder / "config.json").is_file():
        raise HubError(f"{model} has no config.json: not a transformers model repository")
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError, TypeError) as exc:
            raise HubError(f"{model}: {INDEX_FILE} is not a safetensors index ({exc})") from exc
        return [str(s) for s in shards]
    names = [f.path for f in get_cached_repo_tree(model.repo, revision=folder.name)]
    weights = sorted(n for n in names if n.endswith(".safetensors") and "/" not in n)
    if not weights:
        others = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")))
        has = f" (it has {', '.join(others[:4])}{', ...' if len(others) > 4 else ''})" if others else ""
        raise HubError(f"{model} has no *.safetensors weights at its top level{has}; Tandem loads safetensors only: "
                       "pick a repository or revision that has them")
    return weights


def explain(model: HubModel, exc: BaseException) -> str:
    """One message for a failed download: what happened, to which repository, and what to do."""
    from huggingface_hub import constants, errors, get_token

    endpoint = constants.ENDPOINT
    token = get_token()
    status = getattr(getattr(exc, "response", None), "status_code", None)
    cause = exc.__cause__ or exc.__context__
    if isinstance(exc, errors.GatedRepoError):
        if token is None:
            return (f"{model.repo} is a gated repository and no token was sent (HTTP {status}): accept its terms on "
                    f"its page at {endpoint}/{model.repo}, then set HF_TOKEN to a token of that account")
        return (f"{model.repo} is a gated repository and the Hub refused this token (HTTP {status}): the token in "
                f"HF_TOKEN (or the stored login) has no access yet; accept the terms on {endpoint}/{model.repo} "
                "with the token's account, or use another token")
    if isinstance(exc, errors.RevisionNotFoundError):
        return (f"{model.repo} has no revision {model.revision or 'main'!r} (a branch, tag or commit hash) on "
                f"{endpoint}")
    if isinstance(exc, errors.RepositoryNotFoundError):
        auth = "" if token is not None else " or it is private or gated and no token was sent (set HF_TOKEN)"
        return f"no model repository {model.repo} on {endpoint} (HTTP {status}): check the name{auth}"
    if isinstance(exc, errors.HfHubHTTPError) and status in (401, 403):
        return (f"the Hub refused the token for {model.repo} (HTTP {status}: "
                f"{_first_line(exc)}): check HF_TOKEN (or unset it for a public repository)")
    offline = isinstance(cause, errors.OfflineModeIsEnabled) or constants.HF_HUB_OFFLINE
    if isinstance(exc, errors.IncompleteSnapshotError):
        why = "HF_HUB_OFFLINE is set" if offline else f"the Hub at {endpoint} cannot be reached"
        return (f"the cached copy of {model} in {hub_cache()} is incomplete and {why}: download it again with the "
                "network on (tandem fetch-model --model ...)")
    if isinstance(exc, errors.LocalEntryNotFoundError):
        if offline:
            return (f"HF_HUB_OFFLINE is set and {model} is not in the cache {hub_cache()}: download it first "
                    f"(tandem fetch-model --model {model}) with the network on, or point HF_HUB_CACHE at a cache "
                    "that holds it")
        reason = _first_line(cause) if cause is not None else _first_line(exc)
        return (f"cannot reach the Hub at {endpoint} ({reason}) and {model} is not in the cache {hub_cache()}: "
                "check the network or HF_ENDPOINT; with a copy in the cache, HF_HUB_OFFLINE=1 uses it without the "
                "network")
    if isinstance(exc, errors.HfHubHTTPError):
        return f"the Hub at {endpoint} answered HTTP {status} for {model}: {_first_line(exc)}"
    return (f"downloading {model} from {endpoint} into {hub_cache()} failed ({type(exc).__name__}: "
            f"{_first_line(exc)}); run it again: finished files are kept")


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
