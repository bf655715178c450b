"""A local Kubernetes control plane with fake GPU node pools, for tests and demos.

    hack/cluster.sh up   [--state DIR] [--nodes FILE] [--real-node]   build (or reuse) binaries, start, register nodes
    hack/cluster.sh down [--state DIR]                  stop every process it started, remove its state
    hack/cluster.sh env  [--state DIR]                  print `export KUBECONFIG=... PATH=...`
    hack/cluster.sh leftovers [--state DIR]             list what a real node left on this machine (exit 1 if any)

Real etcd, kube-apiserver (RBAC on), kube-controller-manager and kube-scheduler, all on
127.0.0.1 with free ports and locally generated certificates; kwok plays the kubelets, so
pods scheduled on the fake GPU nodes become Running and Ready without containers.
With --real-node, one more node runs real containers (hack/real_node.py); the apiserver then
listens on that node's IP instead of 127.0.0.1, so that pods reach it.
Standard library only, so it runs before any Python package is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contextlib

import k8s_build
import real_node

HERE = Path(__file__).resolve().parent
DEFAULT_NODES_FILE = HERE / "cluster-nodes.json"


def default_state_dir() -> Path:
    return Path(os.environ.get("TANDEM_CLUSTER_DIR") or k8s_build.cache_root() / "cluster")


_handed_out: set[int] = set()


def free_port() -> int:
    """A free port not handed out before by this process (the kernel may offer one twice in a row).
    (tandem.worker.server.ports has the same; this script runs without the package installed.)"""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def log(msg: str) -> None:
    print(f"[cluster] {msg}", file=sys.stderr, flush=True)


# --- certificates -------------------------------------------------------------------------

def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"openssl {' '.join(args)} failed:\n{proc.stderr}")


def make_pki(pki: Path, api_ip: str = "127.0.0.1") -> None:
    """CA, apiserver serving cert, admin client cert (system:masters), service-account key pair."""
    if shutil.which("openssl") is None:
        raise SystemExit("openssl is needed to generate the control plane's certificates")
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "30", "-subj", "/CN=tandem-local-ca", cwd=pki)
    sans = (f"subjectAltName=IP:127.0.0.1,IP:{api_ip},IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
            "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local")
    for name, subj, ext in [
        ("apiserver", "/CN=kube-apiserver", sans),
        ("admin", "/O=system:masters/CN=tandem-admin", "extendedKeyUsage=clientAuth"),
    ]:
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", subj, cwd=pki)
        (pki / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "30", "-extfile", f"{name}.ext", cwd=pki)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(path: Path, server: str, pki: Path) -> None:
    # JSON is valid YAML; kubectl and the Python client both read it.
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "tandem-local",
        "clusters": [{"name": "tandem-local", "cluster": {
            "server": server, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": "tandem-admin", "user": {
            "client-certificate": str(pki / "admin.crt"), "client-key": str(pki / "admin.key")}}],
        "contexts": [{"name": "tandem-local", "context": {
            "cluster": "tandem-local", "user": "tandem-admin", "namespace": "default"}}],
    }
    path.write_text(json.dumps(config, indent=2))


# --- processes ----------------------------------------------------------------------------

class Supervisor:
    def __init__(self, state: Path) -> None:
        self.state = state
        self.logs = state / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.pids_file = state / "pids.json"
        self.pids: dict[str, int] = json.loads(self.pids_file.read_text()) if self.pids_file.exists() else {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str]) -> None:
        out = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it open)
        # New session: `down` signals by pid, and Ctrl-C on the caller does not reach them.
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs[name] = proc
        self.pids[name] = proc.pid
        self.pids_file.write_text(json.dumps(self.pids))

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]
                raise SystemExit(f"{name} exited with code {proc.returncode}; last log lines:\n{tail}")


def wait_for(what: str, probe, sup: Supervisor, timeout: float = 90.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    last_err = ""
    while time.monotonic() < deadline:
        sup.check_alive()
        try:
            if probe():
                return
        except Exception as exc:
            last_err = str(exc)
        time.sleep(0.3)
    raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what} ({last_err}); logs in {sup.logs}")


def https_ok(url: str, pki: Path) -> bool:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    with urllib.request.urlopen(url, context=ctx, timeout=3) as resp:
        return bool(resp.status == 200)


def kubectl(bins: Path, kubeconfig: Path, *args: str, input: str | None = None) -> str:
    proc = subprocess.run([str(bins / "kubectl"), f"--kubeconfig={kubeconfig}", *args],
                          input=input, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


# --- fake GPU nodes -----------------------------------------------------------------------

def node_manifests(pools: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    nodes = []
    for pool in pools:
        for i in range(int(pool["count"])):
            name = f"{pool['name']}-{i}"
            resources = {
                "cpu": str(pool.get("cpu", 64)), "memory": pool.get("memory", "512Gi"),
                "pods": str(pool.get("pods", 110)),
            }
            labels = {
                "type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64", "tandem.dev/pool": pool["name"],
            }
            if pool.get("gpus"):
                resources["nvidia.com/gpu"] = str(pool["gpus"])
                labels["nvidia.com/gpu.product"] = pool["gpuType"]
                labels["nvidia.com/gpu.count"] = str(pool["gpus"])
            if pool.get("rdmaResource"):
                resources[pool["rdmaResource"]] = str(pool.get("rdmaCount", 1000))
            taints = ([{"key": "tandem.dev/pool", "value": pool["name"], "effect": "NoSchedule"}]
                      if pool.get("taint", True) else [])
            nodes.append({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": labels,
                             "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"}},
                "spec": {"taints": taints},
                # kwok's node-initialize stage fills in conditions, addresses and nodeInfo.
                "status": {"capacity": resources, "allocatable": resources},
            })
    return nodes


# --- commands -----------------------------------------------------------------------------

def up(state: Path, nodes_file: Path, with_real_node: bool = False) -> None:
    t0 = time.monotonic()
    if with_real_node:
        real_node.check_prerequisites()
    bins = k8s_build.build()
    if (state / "pids.json").exists():
        raise SystemExit(f"a cluster already runs from {state}; run `hack/cluster.sh down` first")
    if with_real_node and (owner := real_node.owner_of_running_node()):
        raise SystemExit(f"a real node already runs on this machine (state {owner}); "
                         f"run `hack/cluster.sh down --state {owner}` first")
    state.mkdir(parents=True, exist_ok=True)
    pki = state / "pki"
    api_ip = real_node.NODE_IP if with_real_node else "127.0.0.1"
    make_pki(pki, api_ip)
    sup = Supervisor(state)
    try:
        if with_real_node:
            # Before the apiserver: it listens on the node IP, which lives on the node's bridge.
            real_node.record_baseline(real_node.Paths(state))
            real_node.setup_network(state)
        _start(sup, bins, state, pki, nodes_file, api_ip)
        if with_real_node:
            real_node.start(sup, bins, state, pki, state / "kubeconfig", free_port, wait_for, kubectl)
    except RuntimeError as exc:
        down(state, check_leftovers=False)
        raise SystemExit(f"cluster up failed: {exc}") from None
    except BaseException:
        down(state, check_leftovers=False)
        raise
    log(f"control plane up in {time.monotonic() - t0:.1f}s; state in {state}")
    print(env_lines(state))


def _start(sup: Supervisor, bins: Path, state: Path, pki: Path, nodes_file: Path, api_ip: str) -> None:
    etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
    etcd_url = f"http://127.0.0.1:{etcd_port}"
    sup.start("etcd", [
        str(bins / "etcd"), "--name=tandem", f"--data-dir={state / 'etcd'}",
        f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
        f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
        f"--initial-cluster=tandem=http://127.0.0.1:{peer_port}",
        "--unsafe-no-fsync=true", "--quota-backend-bytes=4294967296", "--log-level=warn",
    ])
    wait_for("etcd", lambda: urllib.request.urlopen(f"{etcd_url}/health", timeout=2).status == 200, sup)

    server = f"https://{api_ip}:{api_port}"
    # On 127.0.0.1 the apiserver cannot publish itself as the `kubernetes` Service's endpoint (a
    # loopback address), and nothing needs it to; with a real node, pods reach it through that
    # Service, so the default endpoint reconciler runs and the kubelet's address settings apply.
    node_args = (real_node.apiserver_args(pki) if api_ip != "127.0.0.1"
                 else ["--endpoint-reconciler-type=none"])
    sup.start("kube-apiserver", [
        str(bins / "kube-apiserver"), f"--etcd-servers={etcd_url}",
        f"--bind-address={api_ip}", f"--advertise-address={api_ip}", f"--secure-port={api_port}",
        f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        "--authorization-mode=RBAC", "--service-cluster-ip-range=10.96.0.0/16",
        "--allow-privileged=true", *node_args,
    ])
    wait_for("kube-apiserver /readyz", lambda: https_ok(f"{server}/readyz", pki), sup)
    kubeconfig = state / "kubeconfig"
    write_kubeconfig(kubeconfig, server, pki)

    sup.start("kube-controller-manager", [
        str(bins / "kube-controller-manager"), f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1", "--secure-port=0", "--leader-elect=false",
        f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
    ])
    sup.start("kube-scheduler", [
        str(bins / "kube-scheduler"), f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1", "--secure-port=0", "--leader-elect=false",
    ])
    stages = bins / "kwok-stages.yaml"
    sup.start("kwok", [
        str(bins / "kwok"), f"--kubeconfig={kubeconfig}", f"--config={stages}",
        "--manage-all-nodes=false", "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
        "--cidr=10.244.0.0/16", "--node-ip=10.0.0.1", "--node-lease-duration-seconds=40",
        f"--server-address=127.0.0.1:{free_port()}",
    ])

    pools = json.loads(nodes_file.read_text())["pools"]
    manifests = node_manifests(pools)
    kubectl(bins, kubeconfig, "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                    "items": manifests}))

    def nodes_ready() -> bool:
        out = json.loads(kubectl(bins, kubeconfig, "get", "nodes", "-o", "json"))
        ready = [n for n in out["items"] if any(c["type"] == "Ready" and c["status"] == "True"
                                                for c in n["status"].get("conditions", []))]
        return len(ready) == len(manifests)

    wait_for(f"{len(manifests)} kwok nodes to be Ready", nodes_ready, sup)
    # Pods can be created only once the namespace's default ServiceAccount exists.
    wait_for("the default ServiceAccount",
             lambda: bool(kubectl(bins, kubeconfig, "get", "serviceaccount", "default", "-o", "name")), sup)


def down(state: Path, check_leftovers: bool = True) -> None:
    pids_file = state / "pids.json"
    pids: dict[str, int] = json.loads(pids_file.read_text()) if pids_file.exists() else {}
    count = len(pids)
    has_real_node = (state / "node").exists() or real_node.owner_of_running_node() == str(state)
    left: list[str] = []
    if has_real_node:
        # First, while the apiserver still runs: the kubelet, its containers, containerd.
        real_node.stop(state, pids, _stop_pid)
    # Reverse start order: kwok and the controllers first, etcd last.
    for name, pid in reversed(list(pids.items())):
        _stop_pid(name, pid)
    if has_real_node:
        real_node.unmount_all([str(state)])
        left = real_node.leftovers(state)  # before the baseline it compares with is removed
    if state.exists():
        shutil.rmtree(state, ignore_errors=True)
    log(f"stopped {count} processes; removed {state}")
    if left and check_leftovers:
        raise SystemExit("down left these behind:\n  " + "\n  ".join(left))


def _stop_pid(name: str, pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            waited, _ = os.waitpid(pid, os.WNOHANG)
            if waited == pid:
                return
        except ChildProcessError:
            pass  # not our child (started by another `up` process): poll with signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    log(f"{name} (pid {pid}) ignored SIGTERM; killing it")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def env_lines(state: Path) -> str:
    return (f"export KUBECONFIG={state / 'kubeconfig'}\n"
            f"export PATH={k8s_build.bin_dir()}:$PATH")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hack/cluster.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up", "down", "env", "build", "leftovers"])
    parser.add_argument("--state", type=Path, default=None, help="state folder (default: %(default)s)")
    parser.add_argument("--nodes", type=Path, default=DEFAULT_NODES_FILE,
                        help="JSON file describing the fake GPU pools")
    parser.add_argument("--real-node", action="store_true",
                        help="up: also start a node that runs real containers (root; see hack/real_node.py)")
    args = parser.parse_args(argv)
    state = (args.state or default_state_dir()).resolve()
    if args.command == "build":
        print(k8s_build.build())
    elif args.command == "up":
        up(state, args.nodes, args.real_node)
    elif args.command == "leftovers":
        left = real_node.leftovers(state)
        print("\n".join(left) if left else "nothing left behind")
        sys.exit(1 if left else 0)
    elif args.command == "down":
        down(state)
    else:
        if not (state / "kubeconfig").exists():
            raise SystemExit(f"no cluster runs from {state}; run `hack/cluster.sh up` first")
        print(env_lines(state))


if __name__ == "__main__":
    main()
