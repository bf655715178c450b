"""Check what a user runs, the way a user runs it: the README's first command and the wheel.

    hack/install_check.py quickstart [--python PY]   hack/quickstart.sh in a copy of the checkout
    hack/install_check.py wheel [--python PY]        sdist + wheel, twine check, the wheel in a clean venv

Both start the stack on a fresh cache (so `--model tiny` writes its model, as on a new machine), send
one completion and one streamed chat with the official openai client, press Ctrl-C (SIGINT), and
check that every process the command started is gone. On failure they print the command's own
output and exit 1. Run with the test environment's Python (it needs openai, build and twine);
hack/test.sh runs both.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

from tandem.worker.server.ports import free_port  # run with the test venv, which has Tandem

REPO = Path(__file__).resolve().parent.parent
INSTALL_AND_START_S = 1200  # a first install downloads torch (GBs): generous, but bounded
STOP_S = 60


class CheckFailed(Exception):
    pass


def say(msg: str) -> None:
    print(f"[install-check] {msg}", file=sys.stderr, flush=True)


def copy_checkout(dest: Path) -> None:
    """The files a fresh clone has (tracked and new, not ignored): no .venv, no caches."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def user_env(home: Path) -> dict[str, str]:
    """The caller's environment with an empty Tandem cache; pip keeps the real cache (no re-download)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "TANDEM_"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(REPO / ".venv")))
    env.setdefault("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip"))
    env["TANDEM_CACHE_DIR"] = str(home / "tandem-cache")
    return env


def resolve_python(name: str) -> str:
    """`name` if it runs; else a pyenv build of it (pyenv's shim for a version that is not the
    global one answers 'command not found')."""
    if subprocess.run([name, "--version"], capture_output=True).returncode == 0:
        return name
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for candidate in sorted(root.glob(f"versions/*/bin/{Path(name).name}"), reverse=True):
        if subprocess.run([str(candidate), "--version"], capture_output=True).returncode == 0:
            return str(candidate)
    raise CheckFailed(f"no working {name} here (tried PATH and pyenv's versions)")


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 1800) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise CheckFailed(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr


# --- the process tree -------------------------------------------------------------------------

def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a live process, None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else (int(fields[1]), fields[19])


def descendants(root: int) -> dict[int, str]:
    """Every live process under `root` (root included), with its start time to rule out pid reuse."""
    parents: dict[int, int] = {}
    starts: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            parents[int(entry.name)], starts[int(entry.name)] = st
    found, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                found.add(child)
                frontier.append(child)
    return {pid: starts[pid] for pid in found if pid in starts}


def still_running(procs: dict[int, str]) -> list[int]:
    return [pid for pid, start in procs.items() if (st := _stat(pid)) is not None and st[1] == start]


# --- the stack, as a user drives it ------------------------------------------------------------

def exercise(cmd: list[str], cwd: Path, env: dict[str, str], port: int, log_path: Path,
             while_serving: Sequence[list[str]] = ()) -> None:
    """Start `cmd` (it serves the OpenAI API on `port`), use it, Ctrl-C it, check it left nothing.
    `while_serving`: more commands to run against it ("{url}" stands for http://127.0.0.1:PORT)."""
    import httpx
    import openai

    t0 = time.monotonic()
    with log_path.open("wb") as log:
        # Its own process group, as a shell gives a foreground job: Ctrl-C goes to that group.
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, process_group=0)

    def output() -> str:
        return log_path.read_text(errors="replace")[-6000:]

    try:
        base = f"http://127.0.0.1:{port}/v1"
        while True:
            if proc.poll() is not None:
                raise CheckFailed(f"`{' '.join(cmd)}` exited {proc.returncode} before serving; its output:\n{output()}")
            if time.monotonic() - t0 > INSTALL_AND_START_S:
                raise CheckFailed(f"not serving after {INSTALL_AND_START_S} s; its output:\n{output()}")
            try:
                if httpx.get(f"{base}/models", timeout=2).status_code == 200 and "ready:" in output():
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        say(f"serving at {base} after {time.monotonic() - t0:.0f} s (install included)")

        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
        completion = client.completions.create(model="tiny", prompt="Hello, my name is", max_tokens=8)
        choice = completion.choices[0]
        if not completion.usage or completion.usage.completion_tokens < 1 or choice.finish_reason not in ("length", "stop"):
            raise CheckFailed(f"unexpected completion: {completion}")
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi there"}],
                                                max_tokens=8, stream=True)
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        if not text or finish not in (["length"], ["stop"]):
            raise CheckFailed(f"unexpected chat stream ({len(chunks)} chunks, text {text!r}, finish {finish})")
        say(f"completion ({completion.usage.completion_tokens} tokens) and streamed chat ({len(chunks)} chunks) ok")
        for extra in while_serving:
            argv = [a.replace("{url}", f"http://127.0.0.1:{port}") for a in extra]
            out = run(argv, cwd=cwd, env=env, timeout=300)
            summary = next((line.strip() for line in out.splitlines() if line.startswith("requests:")), "")
            if " 0 failed" not in summary:
                raise CheckFailed(f"`{' '.join(argv[1:])}` reported failures:\n{out[-3000:]}")
            say(f"`{' '.join(argv[1:])}`: {summary}")

        procs = descendants(proc.pid)
        t_stop = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        try:
            code = proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"still running {STOP_S} s after Ctrl-C; its output:\n{output()}") from None
        deadline = time.monotonic() + 10  # children reaped by their parent a moment after it returns
        while (left := still_running(procs)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if left:
            raise CheckFailed(f"after Ctrl-C, {len(left)} of its {len(procs)} processes are still running: {left}")
        if code != 0:
            raise CheckFailed(f"exited {code} on Ctrl-C; its output:\n{output()}")
        say(f"Ctrl-C: exited 0 after {time.monotonic() - t_stop:.1f} s; all {len(procs)} processes gone")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def check_quickstart(python: str | None, work: Path) -> None:
    """`hack/quickstart.sh` exactly as the README says, in a copy of the checkout (fresh .venv)."""
    tree = work / "checkout"
    copy_checkout(tree)
    env = user_env(work)
    if python:
        env["PYTHON"] = resolve_python(python)
    port = free_port()
    say(f"hack/quickstart.sh --port {port} in {tree} (python: {python or 'the script picks'})")
    exercise(["hack/quickstart.sh", "--port", str(port)], tree, env, port, work / "quickstart.log")


def check_wheel(python: str, work: Path) -> None:
    """Build the sdist and the wheel (the wheel from the sdist), check them, install the wheel alone."""
    tree = work / "checkout"
    copy_checkout(tree)
    dist = work / "dist"
    t0 = time.monotonic()
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(tree)], cwd=work)
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        raise CheckFailed(f"expected one wheel and one sdist in {dist}, found {[p.name for p in dist.iterdir()]}")
    run([sys.executable, "-m", "twine", "check", "--strict", *map(str, wheels + sdists)], cwd=work)
    names = zipfile.ZipFile(wheels[0]).namelist()
    if any(n.startswith(("operator/", "worker/")) for n in names) or "tandem/operator/main.py" not in names:
        raise CheckFailed(f"the wheel's packages are not tandem.operator / tandem.worker: {sorted(names)[:20]}")
    say(f"built and checked {wheels[0].name} and {sdists[0].name} in {time.monotonic() - t0:.0f} s")

    venv = work / "venv"
    env = user_env(work)
    t0 = time.monotonic()
    run([resolve_python(python), "-m", "venv", str(venv)], cwd=work, env=env)
    run([str(venv / "bin/pip"), "install", "--quiet", "--disable-pip-version-check", "-c",
         str(tree / "requirements-lock.txt"), f"{wheels[0]}[worker]"], cwd=work, env=env)
    say(f"installed {wheels[0].name}[worker] into a clean {python} venv in {time.monotonic() - t0:.0f} s")
    version = run([str(venv / "bin/tandem"), "--version"], cwd=work, env=env)
    if "0." not in version:
        raise CheckFailed(f"tandem --version said {version!r}")
    doctor = run([str(venv / "bin/tandem"), "doctor", "--no-bandwidth"], cwd=work, env=env)
    say(f"tandem --version: {version.strip()}; tandem doctor ok ({len(doctor.splitlines())} lines)")
    tandem = str(venv / "bin/tandem")
    # Every command the worker extra is documented to cover imports with only that extra.
    for name in ("serve", "worker", "router", "bench", "doctor", "fetch-model", "kv-keys", "make-tiny-model"):
        run([tandem, name, "--help"], cwd=work, env=env)
    port = free_port()
    # Outside the checkout, so nothing but the installed wheel can be imported.
    exercise([tandem, "serve", "--model", "tiny", "--port", str(port)], work, env, port, work / "serve.log",
             while_serving=[[tandem, "bench", "--url", "{url}", "-n", "4", "--rate", "0", "--prompt-tokens", "16",
                             "--output-tokens", "4"]])
    check_operator_extra(python, wheels[0], tree, work, env)


def check_operator_extra(python: str, wheel: Path, tree: Path, work: Path, env: dict[str, str]) -> None:
    """The operator image installs only the operator extra (no torch): every operator module imports."""
    venv = work / "operator-venv"
    run([resolve_python(python), "-m", "venv", str(venv)], cwd=work, env=env)
    run([str(venv / "bin/pip"), "install", "--quiet", "--disable-pip-version-check", "-c",
         str(tree / "requirements-lock.txt"), f"{wheel}[operator]"], cwd=work, env=env)
    modules = sorted(f"tandem.operator.{p.stem}" for p in (tree / "operator").glob("*.py"))
    code = (f"import importlib, importlib.util; [importlib.import_module(m) for m in {modules!r}]; "
            "print(importlib.util.find_spec('torch') is not None)")
    probe = subprocess.run([str(venv / "bin/python"), "-c", code], cwd=work, env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        raise CheckFailed(f"importing the operator's modules with only the operator extra:\n{probe.stderr[-3000:]}")
    if probe.stdout.strip() != "False":
        raise CheckFailed("the operator extra installs torch (the operator image must stay small)")
    run([str(venv / "bin/tandem"), "operator", "--help"], cwd=work, env=env)
    say(f"the operator extra alone: all {len(modules)} operator modules import, `tandem operator --help` ok")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=["quickstart", "wheel"])
    parser.add_argument("--python", default=None, help="interpreter for the new environment")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix=f"tandem-{args.check}-check-"))
    t0 = time.monotonic()
    try:
        if args.check == "quickstart":
            check_quickstart(args.python, work)
        else:
            check_wheel(args.python or "python3", work)
    except (CheckFailed, subprocess.TimeoutExpired) as exc:
        say(f"FAILED: {args.check} check ({time.monotonic() - t0:.0f} s):\n{exc}")
        return 1
    finally:
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    say(f"{args.check} check passed in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
