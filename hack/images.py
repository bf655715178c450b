"""Build Tandem's images locally and load them into the real node's containerd. No registry needed.

    python3 hack/images.py build [--only worker|operator]   base, wheels, then the images (buildah)
    python3 hack/images.py load --state DIR                  import what changed into the node
    python3 hack/images.py all --state DIR                   both

The images come from the project's own docker/*.Dockerfile, with build arguments that swap the
published bases (CUDA, python:3.11-slim, ghcr's uv) for local ones:
- a Debian 12 root file system made with mmdebstrap, with Debian's Python 3.11 (the base);
- an image holding the uv binary from the uv wheel on PyPI (the Dockerfile copies /uv from it);
- a folder of wheels (`pip download`, served from pip's cache when the venv already has them)
  mounted into the build at /wheels, so that the build is offline and torch is not fetched again.
Everything is cached in ~/.cache/tandem/images: the base tarball, the wheels, buildah's store.
The Dockerfiles install dependencies before copying the source, so a code change rebuilds only
the last small layers; `load` then hands containerd only the layers it lacks (rewritten from
buildah's store, not pushed), and skips an image whose ID it already has. The images are tagged tandem/worker:dev and tandem/operator:dev
(docker.io/tandem/...:dev to containerd, which is what a pod's `image: tandem/worker:dev` means).
Standard library only.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import k8s_build  # noqa: E402
import real_node  # noqa: E402

DEBIAN_SUITE = "bookworm"
# The base: Python 3.11 from Debian, the venv module (the operator image), and CA certificates.
BASE_PACKAGES = ["python3", "python3-venv", "ca-certificates"]
IMAGES = {
    # name -> (Dockerfile, local tag, build arguments beyond the common ones)
    "worker": ("docker/worker.Dockerfile", "tandem/worker:dev",
               {"PYTHON_FROM": "system", "RDMA": "0", "UV_INSTALL_ARGS": "--no-index --find-links /wheels"}),
    "operator": ("docker/operator.Dockerfile", "tandem/operator:dev",
                 {"PIP_INSTALL_ARGS": "--no-index --find-links /wheels"}),
}
# setuptools and wheel: the build backend pyproject.toml names, installed offline from /wheels too.
BUILD_BACKEND = ["setuptools>=77", "wheel"]


def log(msg: str, t0: float = time.monotonic()) -> None:
    print(f"[images {time.monotonic() - t0:6.0f}s] {msg}", file=sys.stderr, flush=True)


def run(*argv: str, capture: bool = True, input: bytes | None = None) -> str:
    """Run a tool; uncaptured, its output goes to our stderr (stdout is for results callers parse)."""
    if capture:
        proc = subprocess.run(list(argv), capture_output=True, input=input)
    else:
        proc = subprocess.run(list(argv), stdout=sys.stderr, input=input)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace")[-4000:] if capture else ""
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(argv)}\n{err}")
    return proc.stdout.decode(errors="replace") if capture else ""


def cache_dir() -> Path:
    return k8s_build.cache_root() / "images"


def key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


# --- buildah, with its store in our cache folder -------------------------------------------

def buildah(*args: str, capture: bool = True) -> str:
    store = cache_dir() / "buildah"
    return run("buildah", f"--root={store / 'root'}", f"--runroot={store / 'run'}",
               "--storage-driver=overlay", *args, capture=capture)


def image_id(tag: str) -> str | None:
    try:
        return buildah("images", "--noheading", "--no-trunc", "--format", "{{.ID}}", tag).strip() or None
    except SystemExit:  # no such image
        return None


# --- the base image ----------------------------------------------------------------------

def base_tag() -> str:
    return f"localhost/tandem-base:{DEBIAN_SUITE}-{key(DEBIAN_SUITE, BASE_PACKAGES)}"


def build_base() -> str:
    """Debian with Python from Debian's own packages, made with mmdebstrap (no registry)."""
    tag = base_tag()
    if image_id(tag):
        return tag
    rootfs = cache_dir() / f"{tag.split(':')[1]}.tar"
    if not rootfs.exists():
        log(f"mmdebstrap {DEBIAN_SUITE} with {', '.join(BASE_PACKAGES)}")
        run("mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
            # No documentation in an image; keep the licences.
            "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-include=/usr/share/doc/*/copyright",
            "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/locale/*",
            "--aptopt=Acquire::Languages \"none\"",
            "--customize-hook=rm -rf \"$1\"/var/lib/apt/lists/* \"$1\"/var/cache/apt/*",
            DEBIAN_SUITE, str(rootfs.with_suffix(".tmp.tar")))
        os.replace(rootfs.with_suffix(".tmp.tar"), rootfs)
    container = buildah("from", "scratch").strip()
    try:
        buildah("add", container, str(rootfs), "/")
        buildah("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--env", "LANG=C.UTF-8", "--cmd", "/bin/bash", container)
        buildah("commit", "--quiet", container, tag)
    finally:
        buildah("rm", container)
    log(f"base image {tag}")
    return tag


# --- wheels ------------------------------------------------------------------------------

def uv_version() -> str:
    """The uv the published build uses: the tag of the Dockerfile's UV_IMAGE default."""
    text = (REPO / "docker" / "worker.Dockerfile").read_text()
    m = re.search(r"^ARG UV_IMAGE=\S+:(\S+)$", text, re.M)
    if not m:
        raise SystemExit("cannot find `ARG UV_IMAGE=...:VERSION` in docker/worker.Dockerfile")
    return m.group(1)


def requirements() -> list[str]:
    """Runtime dependencies of the worker and operator images, from pyproject.toml."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [*project["dependencies"], *extras["worker"], *extras["operator"]]


def wheels_dir() -> Path:
    lock = (REPO / "requirements-lock.txt").read_bytes()
    return cache_dir() / f"wheels-{key(requirements(), lock.decode(), uv_version(), BUILD_BACKEND)}"


def download_wheels() -> Path:
    """pip download into a folder keyed by what it holds; pip's cache serves what the venv already
    downloaded (torch and its CUDA libraries: gigabytes), so this is mostly a local copy."""
    out = wheels_dir()
    if (out / ".complete").exists():
        return out
    tmp = out.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "requirements.txt").write_text("\n".join(requirements() + BUILD_BACKEND) + "\n")
    log(f"pip download into {out.name} (from pip's cache where it can)")
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
           "--only-binary=:all:", "--dest", str(tmp)]
    run(*pip, "-c", str(REPO / "requirements-lock.txt"), "-r", str(tmp / "requirements.txt"), capture=False)
    run(*pip, "--no-deps", f"uv=={uv_version()}", capture=False)
    (tmp / ".complete").write_text("")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def build_uv_image(wheels: Path) -> str:
    """An image with /uv, as ghcr.io/astral-sh/uv has, taken from the uv wheel on PyPI."""
    tag = f"localhost/tandem-uv:{uv_version()}"
    if image_id(tag):
        return tag
    wheel = next(wheels.glob(f"uv-{uv_version()}-*.whl"))
    binary = cache_dir() / "uv"
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith("/scripts/uv"))
        binary.write_bytes(zf.read(member))
    binary.chmod(0o755)
    container = buildah("from", "scratch").strip()
    try:
        buildah("copy", "--chmod=0755", container, str(binary), "/uv")
        buildah("commit", "--quiet", container, tag)
    finally:
        buildah("rm", container)
    return tag


# --- the images --------------------------------------------------------------------------

def build_image(name: str, base: str, uv_image: str, wheels: Path) -> str:
    dockerfile, tag, extra_args = IMAGES[name]
    args = {"BASE_IMAGE": base, "PYTHON_IMAGE": base, "UV_IMAGE": uv_image, **extra_args}
    t0 = time.monotonic()
    buildah("build", "--layers", "--network=none", f"--volume={wheels}:/wheels:ro",
            f"--ignorefile={REPO / (dockerfile + '.dockerignore')}", "-f", str(REPO / dockerfile),
            *[f"--build-arg={k}={v}" for k, v in args.items() if k in (REPO / dockerfile).read_text()],
            "-t", tag, str(REPO), capture=False)
    log(f"{tag} built in {time.monotonic() - t0:.0f}s: {image_size(tag)}")
    return tag


def image_size(tag: str) -> str:
    return buildah("images", "--noheading", "--format", "{{.Size}}", tag).strip()


def build(only: list[str]) -> None:
    # Working containers a killed or failed build left behind: one held a half-committed 7 GB layer
    # and 9 more piled up from earlier runs (seen this session; the next build then ran out of disk).
    # Only these scripts use this buildah store.
    buildah("rm", "--all")
    base = build_base()
    wheels = download_wheels()
    uv_image = build_uv_image(wheels)
    for name in only:
        build_image(name, base, uv_image, wheels)
    prune(wheels)


def prune(wheels: Path) -> None:
    """Drop what no current image can use again: the wheel folders of other locks, and the images of
    earlier builds whose layers left the current images' chains (a lock change rebuilds the worker's
    7 GB dependency layer; without this each one stayed, and a day of work filled the disk). The
    intermediate images of the current chains stay: they are the layer cache of the next build."""
    for old in cache_dir().glob("wheels-*"):
        if old != wheels and old.is_dir():
            log(f"removing {old.name} (another lock's wheels)")
            shutil.rmtree(old, ignore_errors=True)
    images = json.loads((storage_root() / "overlay-images" / "images.json").read_text())
    parents = {layer["id"]: layer.get("parent") for layer in
               json.loads((storage_root() / "overlay-layers" / "layers.json").read_text())}
    current: set[str] = set()
    for image in images:
        layer = image.get("layer") if image.get("names") else None
        while layer and layer not in current:
            current.add(layer)
            layer = parents.get(layer)
    stale = [i["id"] for i in images if not i.get("names") and i.get("layer") not in current]
    if stale:
        log(f"removing {len(stale)} images of earlier builds")
        buildah("rmi", "--force", *stale)


# --- loading into containerd --------------------------------------------------------------

def containerd_name(tag: str) -> str:
    return f"docker.io/{tag}"


# buildah keeps each image's manifest (layers as uncompressed tars, by their digests) and config,
# and each layer as a folder plus its tar-split record: enough to write the layer's original tar
# again, byte for byte, without `buildah push` (which re-reads and re-digests every layer: minutes
# for the worker's gigabytes, even when containerd has them all).

def storage_root() -> Path:
    return cache_dir() / "buildah" / "root"


def stored_image(image: str) -> tuple[bytes, str, bytes]:
    """(manifest, its digest, config) of a buildah image, as buildah stored them."""
    folder = storage_root() / "overlay-images" / image.removeprefix("sha256:")
    record = next(i for i in json.loads((storage_root() / "overlay-images" / "images.json").read_text())
                  if i["id"] == image.removeprefix("sha256:"))
    manifest = (folder / "manifest").read_bytes()
    config_digest = json.loads(manifest)["config"]["digest"]
    config = (folder / ("=" + base64.b64encode(config_digest.encode()).decode())).read_bytes()
    return manifest, record["big-data-digests"]["manifest"], config


def layer_folders() -> dict[str, str]:
    """Uncompressed digest -> storage layer id."""
    layers = json.loads((storage_root() / "overlay-layers" / "layers.json").read_text())
    return {layer["diff-digest"]: layer["id"] for layer in layers if layer.get("diff-digest")}


def write_layer(layer_id: str, out: io.BufferedIOBase) -> None:
    """The layer's tar as it was committed: tar-split's raw header segments, file contents from
    the layer's folder in between."""
    diff = storage_root() / "overlay" / layer_id / "diff"
    with gzip.open(storage_root() / "overlay-layers" / f"{layer_id}.tar-split.gz", "rt") as entries:
        for line in entries:
            entry = json.loads(line)
            if entry["type"] == 2:  # a segment: header or padding bytes
                out.write(base64.b64decode(entry.get("payload") or ""))
            elif entry.get("size"):  # a file's content
                name = entry.get("name") or base64.b64decode(entry["name_raw"]).decode("surrogateescape")
                with open(diff / name, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)


class _Counter(io.RawIOBase):
    """Passes writes through, counting them: the layer must come out at its recorded size."""

    def __init__(self, out: io.BufferedIOBase) -> None:
        self.out, self.count = out, 0

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.out.write(data)
        self.count += len(data)
        return len(data)


def import_into_containerd(paths: real_node.Paths, image: str, name: str, have: set[str]) -> int:
    """Stream an OCI archive of a buildah image into `ctr images import`, with only the blobs
    containerd lacks: the importer takes the rest from its content store (after a code change a
    few megabytes move, not the gigabytes of torch). containerd checks every blob's digest.
    Returns the bytes of blobs sent."""
    manifest, manifest_digest, config = stored_image(image)
    layers = json.loads(manifest)["layers"]
    folders = layer_folders()
    entry = {"mediaType": json.loads(manifest).get("mediaType", "application/vnd.oci.image.manifest.v1+json"),
             "digest": manifest_digest, "size": len(manifest), "annotations": {"io.containerd.image.name": name}}
    small = {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}',
             "index.json": json.dumps({"schemaVersion": 2, "manifests": [entry]}).encode(),
             f"blobs/{manifest_digest.replace(':', '/')}": manifest,
             f"blobs/{json.loads(manifest)['config']['digest'].replace(':', '/')}": config}
    proc = subprocess.Popen(["ctr", "--address", str(paths.socket), "-n", real_node.K8S_NAMESPACE,
                             "images", "import", "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert proc.stdin is not None
    sent = 0
    with tarfile.open(fileobj=proc.stdin, mode="w|") as tar:
        for arcname, data in small.items():
            info = tarfile.TarInfo(arcname)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for layer in layers:
            if layer["digest"] in have:
                continue
            # The member by hand (header, content, padding) through the archive's own stream:
            # the content is generated, and tarfile would want it as a file.
            info = tarfile.TarInfo(f"blobs/{layer['digest'].replace(':', '/')}")
            info.size = layer["size"]
            header = info.tobuf(tar.format, tar.encoding, tar.errors)
            counter = _Counter(tar.fileobj)  # type: ignore[arg-type]
            counter.write(header)
            write_layer(folders[layer["digest"]], counter)  # type: ignore[arg-type]
            if counter.count != len(header) + layer["size"]:
                raise SystemExit(f"layer {layer['digest']} came out {counter.count - len(header)} bytes, "
                                 f"not {layer['size']}")
            counter.write(b"\0" * (-layer["size"] % tarfile.BLOCKSIZE))
            tar.offset += counter.count
            sent += layer["size"]
    proc.stdin.close()
    if proc.wait() != 0:
        raise ImportFailed(f"ctr images import of {name} failed (exit {proc.returncode})")
    return sent


class ImportFailed(Exception):
    pass


IMAGE_ID_LABEL = "dev.tandem.buildah-image-id"


def imported_id(paths: real_node.Paths, target: str) -> str | None:
    """The buildah image ID the containerd image was imported from (a label we put on it)."""
    out = real_node.ctr(paths, "images", "ls", f"name=={target}", check=False).stdout.decode()
    for word in out.split():
        if word.startswith(IMAGE_ID_LABEL + "="):
            return word.split("=", 1)[1].split(",")[0]
    return None


def load(state: Path, only: list[str]) -> None:
    paths = real_node.Paths(state)
    if not paths.socket.exists():
        raise SystemExit(f"no real node runs from {state} (no {paths.socket}); "
                         "run `hack/cluster.sh up --real-node` first")
    for name in only:
        tag = IMAGES[name][1]
        target = containerd_name(tag)
        built = image_id(tag)
        if built is None:
            raise SystemExit(f"no image {tag}: run `python3 hack/images.py build` first")
        # Checked before the export: exporting the worker reads all of its gigabytes.
        if imported_id(paths, target) == built:
            log(f"{target} unchanged ({built[:12]}): not imported again")
            continue
        t0 = time.monotonic()
        sent = None
        # containerd's garbage collector, woken by the previous import replacing a tag, can remove a
        # snapshot the next unpack counts on ("parent snapshot ... does not exist"; seen once in a
        # dozen loads): read what containerd has again and retry, then send every blob.
        for attempt, everything in ((1, False), (2, False), (3, True)):
            have = set() if everything else set(real_node.ctr(paths, "content", "ls", "-q").stdout.decode().split())
            try:
                sent = import_into_containerd(paths, built, target, have)
                break
            except ImportFailed as exc:
                if everything:
                    raise SystemExit(str(exc)) from None
                log(f"{exc}; attempt {attempt + 1} in 3 s" + (" with every blob" if attempt == 2 else ""))
                time.sleep(3)
        assert sent is not None
        real_node.ctr(paths, "images", "label", target, f"{IMAGE_ID_LABEL}={built}")
        log(f"{target} imported in {time.monotonic() - t0:.0f}s ({sent / 2**20:.0f} MiB of new blobs)")
    collect_garbage(paths)


def collect_garbage(paths: real_node.Paths) -> None:
    """Drop the images a load replaced. The CRI plugin keeps a `sha256:<config>` reference to every image
    it has seen, so a replaced tag left the old image (7 GB of blobs and as much in snapshots, for each
    dependency change of the worker) in the store for good. References of that form whose config no
    named image has are removed; --sync waits for containerd to collect what they held. What running
    containers use stays until a later load."""
    refs: dict[str, str] = {}  # reference -> manifest digest
    for line in real_node.ctr(paths, "images", "ls").stdout.decode().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3:
            refs[fields[0]] = fields[2]
    current = set()
    for ref, digest in refs.items():
        if not ref.startswith("sha256:"):
            manifest = json.loads(real_node.ctr(paths, "content", "get", digest).stdout)
            current.add(manifest["config"]["digest"])
    stale = [ref for ref in refs if ref.startswith("sha256:") and ref not in current]
    if stale:
        removed = real_node.ctr(paths, "images", "rm", "--sync", *stale, check=False)
        log(f"removed {len(stale)} replaced image(s) from containerd" if removed.returncode == 0 else
            f"could not remove replaced images: {removed.stderr.decode(errors='replace').strip()[:300]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hack/images.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build", "load", "all"])
    parser.add_argument("--only", choices=sorted(IMAGES), action="append", help="default: every image")
    parser.add_argument("--state", type=Path, help="the cluster's state folder (load)")
    args = parser.parse_args(argv)
    only = args.only or list(IMAGES)
    if args.command in ("build", "all"):
        for tool in ("buildah", "mmdebstrap"):
            if shutil.which(tool) is None:
                raise SystemExit(f"`{tool}` is missing: apt-get install buildah mmdebstrap")
        build(only)
    if args.command in ("load", "all"):
        if args.state is None:
            parser.error("load needs --state (the folder `hack/cluster.sh up --real-node` runs from)")
        load(args.state.resolve(), only)


if __name__ == "__main__":
    main()
