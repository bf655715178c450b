"""The real node of `hack/cluster.sh up --real-node`: a kubelet that runs containers on this machine.

Beside the kwok pools, one node named `tandem-node` runs real pods: Debian's containerd and runc,
the kubelet and kube-proxy built from the same pinned Kubernetes release as the control plane, and
a CNI bridge. Everything stays on this machine: the node IP is a /32 on a bridge of its own, pods
live on a second bridge whose only way out is the host itself (no forwarding, no masquerade), and
the apiserver is bound to the node IP so that pods reach it through the `kubernetes` Service.

What this machine needs, found by trying (docs/development.md, "The real node"):
- cgroups v1 (hybrid): `failCgroupV1: false` and `cgroupDriver: cgroupfs` in the kubelet config.
- No CAP_SYS_RESOURCE, so no process may lower its oom_score_adj: containerd's CRI plugin runs
  with `restrict_oom_score_adj = true`, else every sandbox fails to start.
- No `dummy` link type, and a loopback address is not accepted as a node's InternalIP: the node
  IP lives on an empty bridge.
- No registry: the sandbox ("pause") image is a static C binary built here and imported.

`down` undoes all of it: processes by pid, mounts, links, iptables chains, the kubelet's cgroups,
the kernel settings the kubelet and kube-proxy change, and the host folders they create.
`leftovers()` lists whatever is still there, so tests can check that nothing is.
Standard library only, like hack/cluster.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import k8s_build

NODE_NAME = "tandem-node"
NODE_IP = "10.87.0.1"
NODE_LINK = "tandem-node"        # bridge with no ports that holds NODE_IP/32
POD_BRIDGE = "tandem-cni0"       # the pods' bridge; the host is its gateway
POD_SUBNET = "10.88.0.0/24"
POD_GATEWAY = "10.88.0.1"
CNI_NETWORK = "tandem-pods"
CNI_BIN_DIR = Path("/usr/lib/cni")
PAUSE_IMAGE = "docker.io/tandem/pause:dev"
K8S_NAMESPACE = "k8s.io"          # containerd namespace the CRI plugin uses

# What the node advertises. The GPUs are fake (the device-plugin-free way: a node status patch);
# pods on this node run on the CPU. The labels let a DisaggregatedModel pin both pools here.
FAKE_GPUS = 8
RDMA_RESOURCE = "rdma/rdma_shared_device_a"
RDMA_COUNT = 1000
NODE_LABELS = {
    "tandem.dev/real-node": "true",
    "nvidia.com/gpu.product": "tandem-fake-gpu",
    "nvidia.com/gpu.count": str(FAKE_GPUS),
}

# Host folders the kubelet, containerd or CNI create outside our state folder even when told where
# to keep their state (hard-coded paths). `down` removes those that did not exist before `up`.
HOST_PATHS = ["/var/lib/cni", "/var/log/containers", "/var/log/pods", "/run/containerd",
              "/var/run/netns", "/var/lib/kubelet", "/opt/containerd"]
# Kernel settings the kubelet (protectKernelDefaults: false sets them) and kube-proxy may change.
SYSCTLS = ["net.ipv4.ip_forward", "net.ipv4.conf.all.route_localnet",
           "net.bridge.bridge-nf-call-iptables", "net.bridge.bridge-nf-call-ip6tables",
           "vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
           "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes", "net.netfilter.nf_conntrack_max"]
IPTABLES = ["iptables", "ip6tables", "iptables-legacy", "ip6tables-legacy"]
OUR_CHAIN = re.compile(r"^(KUBE-|CNI-)")

PAUSE_C = r"""
/* The pod sandbox's process: hold the namespaces, reap orphans, exit on SIGINT/SIGTERM. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void down(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
    struct sigaction sa = {0};
    sa.sa_handler = down; sigaction(SIGINT, &sa, 0); sigaction(SIGTERM, &sa, 0);
    sa.sa_handler = reap; sa.sa_flags = SA_NOCLDSTOP; sigaction(SIGCHLD, &sa, 0);
    for (;;) pause();
}
"""


def log(msg: str) -> None:
    print(f"[real-node] {msg}", flush=True, file=sys.stderr)


def run(*argv: str, check: bool = True, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    proc = subprocess.run(list(argv), capture_output=True, input=input)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.decode(errors='replace').strip()}")
    return proc


# --- paths --------------------------------------------------------------------------------

def containerd_version() -> str:
    out = run("containerd", "--version").stdout.decode().split()
    return out[2].split("~")[0] if len(out) > 2 else "unknown"


def runtime_root() -> Path:
    """containerd's image store, kept across `down` (importing the worker image takes minutes)."""
    return k8s_build.cache_root() / f"containerd-{containerd_version()}"


class Paths:
    """Where the node keeps its state: everything under STATE/node, except the image store."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.node = state / "node"
        self.containerd_state = self.node / "containerd"
        self.socket = self.containerd_state / "containerd.sock"
        self.containerd_config = self.node / "containerd.toml"
        self.cni_conf_dir = self.node / "cni" / "net.d"
        self.cni_ipam_dir = self.node / "cni" / "ipam"
        self.kubelet_root = self.node / "kubelet"
        self.kubelet_config = self.node / "kubelet-config.json"
        self.kube_proxy_config = self.node / "kube-proxy-config.json"
        self.pod_logs = self.node / "pod-logs"
        self.baseline = self.node / "baseline.json"


def ctr(paths: Paths, *args: str, check: bool = True, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return run("ctr", "--address", str(paths.socket), "-n", K8S_NAMESPACE, *args, check=check, input=input)


# --- prerequisites ------------------------------------------------------------------------

APT_HINT = "apt-get install containerd runc containernetworking-plugins iptables conntrack gcc libc6-dev"


def check_prerequisites() -> None:
    problems = []
    if os.geteuid() != 0:
        problems.append("the real node needs root (network devices, mounts, cgroups)")
    for tool in ["containerd", "containerd-shim-runc-v2", "ctr", "runc", "iptables", "conntrack", "ip", "gcc"]:
        if shutil.which(tool) is None:
            problems.append(f"`{tool}` is not on PATH")
    for plugin in ["bridge", "host-local", "loopback"]:
        if not (CNI_BIN_DIR / plugin).exists():
            problems.append(f"CNI plugin {CNI_BIN_DIR / plugin} is missing")
    if not Path("/sys/fs/cgroup/memory").is_dir() and not Path("/sys/fs/cgroup/cgroup.controllers").exists():
        problems.append("no memory cgroup hierarchy under /sys/fs/cgroup")
    if problems:
        raise SystemExit("cannot start the real node:\n  - " + "\n  - ".join(problems) + f"\n({APT_HINT})")


def link_exists(name: str) -> bool:
    return run("ip", "link", "show", name, check=False).returncode == 0


def owner_of_running_node() -> str | None:
    """The state folder of the real node already up on this machine, if any (kept as the link's alias)."""
    if not link_exists(NODE_LINK):
        return None
    out = run("ip", "-j", "link", "show", NODE_LINK).stdout
    return str(json.loads(out)[0].get("ifalias") or "unknown")


# --- host baseline: what `down` restores and `leftovers` compares with ---------------------

def sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctls() -> dict[str, str]:
    values = {}
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            values[name] = sysctl_path(name).read_text().strip()
    return values


def iptables_rules() -> dict[str, list[str]]:
    """Each available iptables variant's rules and user chains, without counters: the comparable part."""
    rules = {}
    for tool in IPTABLES:
        if shutil.which(f"{tool}-save") is None:
            continue
        proc = run(f"{tool}-save", check=False)
        lines = proc.stdout.decode(errors="replace").splitlines()
        rules[tool] = sorted(line for line in lines if line.startswith("-A ")
                             or (line.startswith(":") and line.split()[1] == "-"))
    return rules


def record_baseline(paths: Paths) -> None:
    paths.node.mkdir(parents=True, exist_ok=True)
    baseline = {
        "existing_paths": [p for p in HOST_PATHS if os.path.lexists(p)],
        "sysctls": read_sysctls(),
        "iptables": iptables_rules(),
    }
    paths.baseline.write_text(json.dumps(baseline, indent=1))


def load_baseline(paths: Paths) -> dict:  # type: ignore[type-arg]
    with contextlib.suppress(OSError, ValueError):
        return json.loads(paths.baseline.read_text())  # type: ignore[no-any-return]
    # No record (a failed `up`): assume only what a Debian host without Kubernetes has.
    return {"existing_paths": [], "sysctls": {}, "iptables": {}}


# --- network ------------------------------------------------------------------------------

def setup_network(state: Path) -> None:
    """Two bridges: the node IP's (no ports; a /32 the kubelet, apiserver and pods all reach) and
    the pods' (made here rather than by the CNI plugin, so that the plugin never turns on IP
    forwarding: the host answers pods itself and routes nothing of theirs anywhere else)."""
    run("ip", "link", "add", NODE_LINK, "type", "bridge")
    run("ip", "link", "set", NODE_LINK, "alias", str(state))
    run("ip", "addr", "add", f"{NODE_IP}/32", "dev", NODE_LINK)
    run("ip", "link", "set", NODE_LINK, "up")
    run("ip", "link", "add", POD_BRIDGE, "type", "bridge")
    run("ip", "addr", "add", f"{POD_GATEWAY}/{POD_SUBNET.split('/')[1]}", "dev", POD_BRIDGE)
    run("ip", "link", "set", POD_BRIDGE, "up")


def cni_config(paths: Paths) -> dict:  # type: ignore[type-arg]
    return {
        "cniVersion": "1.0.0", "name": CNI_NETWORK,
        "plugins": [{
            "type": "bridge", "bridge": POD_BRIDGE,
            # The bridge already has the gateway address; isGateway would also enable ip_forward.
            "isGateway": False, "ipMasq": False, "hairpinMode": True,
            "ipam": {
                "type": "host-local", "dataDir": str(paths.cni_ipam_dir),
                "ranges": [[{"subnet": POD_SUBNET, "gateway": POD_GATEWAY}]],
                "routes": [{"dst": "0.0.0.0/0", "gw": POD_GATEWAY}],
            },
        }],
    }


# --- the sandbox image --------------------------------------------------------------------

def build_pause_binary(out: Path) -> None:
    src = out.with_suffix(".c")
    src.write_text(PAUSE_C)
    run("gcc", "-static", "-Os", "-s", "-o", str(out), str(src))


def _tar_bytes(files: dict[str, tuple[bytes, int]]) -> bytes:
    """A reproducible tar (fixed times and owners): same content, same digest, no re-import."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, (data, mode) in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def oci_archive(name: str, layers: list[bytes], config: dict) -> bytes:  # type: ignore[type-arg]
    """An OCI image layout as one tar, named NAME for `ctr images import` (io.containerd.image.name)."""
    layer_blobs = [_blob(layer) for layer in layers]
    config = dict(config, rootfs={"type": "layers", "diff_ids": [d for d, _ in layer_blobs]})
    config_digest, config_data = _blob(json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest,
                   "size": len(config_data)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": len(b)}
                   for d, b in layer_blobs],
    }
    manifest_digest, manifest_data = _blob(json.dumps(manifest, sort_keys=True).encode())
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest,
        "size": len(manifest_data), "annotations": {"io.containerd.image.name": name},
        "platform": {"architecture": "amd64", "os": "linux"}}]}
    files = {"oci-layout": (b'{"imageLayoutVersion":"1.0.0"}', 0o644),
             "index.json": (json.dumps(index).encode(), 0o644)}
    for digest, data in [*layer_blobs, (config_digest, config_data), (manifest_digest, manifest_data)]:
        files[f"blobs/sha256/{digest.split(':')[1]}"] = (data, 0o644)
    return _tar_bytes(files)


def pause_archive(workdir: Path) -> bytes:
    binary = workdir / "pause"
    build_pause_binary(binary)
    layer = _tar_bytes({"pause": (binary.read_bytes(), 0o755)})
    config = {"architecture": "amd64", "os": "linux", "config": {"Entrypoint": ["/pause"]}}
    return oci_archive(PAUSE_IMAGE, [layer], config)


def image_present(paths: Paths, name: str) -> bool:
    return name in ctr(paths, "images", "ls", "-q").stdout.decode().split()


# --- configuration files ------------------------------------------------------------------

def containerd_toml(paths: Paths) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{runtime_root()}"
state = "{paths.containerd_state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{paths.socket}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{paths.node / 'opt'}"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  # This machine withholds CAP_SYS_RESOURCE: no container may get a lower oom_score_adj than ours.
  restrict_oom_score_adj = true
  # Network namespaces under our state folder rather than /var/run/netns, so `down` finds them.
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{paths.node / 'runc'}"
  [{cri}.cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{paths.cni_conf_dir}"
    max_conf_num = 1
"""


def kubelet_config(paths: Paths, pki: Path, port: int, healthz_port: int) -> dict:  # type: ignore[type-arg]
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        # cgroups v1 here: allowed explicitly, and driven through cgroupfs (there is no systemd).
        "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupRoot": "/",
        "containerRuntimeEndpoint": f"unix://{paths.socket}",
        "address": NODE_IP, "port": port, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": healthz_port,
        # The apiserver authenticates with the admin client certificate (logs, exec, port-forward).
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(pki / "ca.crt")}},
        "authorization": {"mode": "AlwaysAllow"},
        "podLogsDir": str(paths.pod_logs),
        "resolvConf": "/etc/resolv.conf",
        "failSwapOn": False,
        # Never garbage-collect the locally built images: they cannot be pulled again.
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "200Mi", "nodefs.available": "2%", "imagefs.available": "2%"},
        "maxPods": 60,
        "serializeImagePulls": False,
        "runtimeRequestTimeout": "10m",
        "nodeStatusUpdateFrequency": "5s",
    }


def kube_proxy_config(kubeconfig: Path, healthz_port: int, metrics_port: int) -> dict:  # type: ignore[type-arg]
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables", "hostnameOverride": NODE_NAME, "clusterCIDR": POD_SUBNET,
        "bindAddress": NODE_IP,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}", "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        # NodePorts only on the node IP: not on 127.0.0.1 (route_localnet) nor on eth0.
        "nodePortAddresses": [f"{NODE_IP}/32"],
        # Leave the host's conntrack limits and its oom_score_adj (we may not lower it) alone.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "oomScoreAdj": 0,
    }


def write_configs(paths: Paths, pki: Path, kubeconfig: Path, ports: dict[str, int]) -> None:
    for folder in (paths.containerd_state, paths.cni_conf_dir, paths.cni_ipam_dir, paths.kubelet_root,
                   paths.pod_logs):
        folder.mkdir(parents=True, exist_ok=True)
    runtime_root().mkdir(parents=True, exist_ok=True)
    paths.containerd_config.write_text(containerd_toml(paths))
    (paths.cni_conf_dir / f"10-{CNI_NETWORK}.conflist").write_text(json.dumps(cni_config(paths), indent=1))
    paths.kubelet_config.write_text(json.dumps(
        kubelet_config(paths, pki, ports["kubelet"], ports["kubelet-healthz"]), indent=1))
    paths.kube_proxy_config.write_text(json.dumps(
        kube_proxy_config(kubeconfig, ports["proxy-healthz"], ports["proxy-metrics"]), indent=1))


# --- start --------------------------------------------------------------------------------

def apiserver_args(pki: Path) -> list[str]:
    """What the apiserver needs for a real node: reach the kubelet by its IP, with a client cert."""
    return ["--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={pki / 'admin.crt'}", f"--kubelet-client-key={pki / 'admin.key'}"]


def start(sup, bins: Path, state: Path, pki: Path, kubeconfig: Path,  # type: ignore[no-untyped-def]
          free_port: Callable[[], int], wait_for: Callable, kubectl: Callable[..., str]) -> None:  # type: ignore[type-arg]
    """Start containerd, the kubelet and kube-proxy; return once the node is Ready and advertises
    its fake GPUs. `sup`, `wait_for` and `kubectl` are hack/cluster.py's."""
    paths = Paths(state)
    ports = {name: free_port() for name in ("kubelet", "kubelet-healthz", "proxy-healthz", "proxy-metrics")}
    write_configs(paths, pki, kubeconfig, ports)
    t0 = time.monotonic()
    sup.start("containerd", ["containerd", f"--config={paths.containerd_config}", "--log-level=warn"])
    wait_for("containerd", lambda: ctr(paths, "version", check=False).returncode == 0, sup)
    remove_containers(paths)  # a previous `down` that did not finish may have left some
    if not image_present(paths, PAUSE_IMAGE):
        ctr(paths, "images", "import", "-", input=pause_archive(paths.node))
    log(f"containerd {containerd_version()} up in {time.monotonic() - t0:.1f}s (images in {runtime_root()})")
    labels = ",".join(f"{k}={v}" for k, v in NODE_LABELS.items())
    sup.start("kubelet", [
        str(bins / "kubelet"), f"--config={paths.kubelet_config}", f"--kubeconfig={kubeconfig}",
        f"--root-dir={paths.kubelet_root}", f"--hostname-override={NODE_NAME}", f"--node-ip={NODE_IP}",
        f"--node-labels={labels}", "--v=1",
    ])
    sup.start("kube-proxy", [str(bins / "kube-proxy"), f"--config={paths.kube_proxy_config}", "--v=1"])

    def node_ready() -> bool:
        node = json.loads(kubectl(bins, kubeconfig, "get", "node", NODE_NAME, "-o", "json"))
        return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])

    wait_for(f"node {NODE_NAME} to be Ready", node_ready, sup, timeout=120)
    advertise_fake_devices(bins, kubeconfig, kubectl, rdma=True)
    wait_for(f"{NODE_NAME} to advertise nvidia.com/gpu",
             lambda: allocatable(bins, kubeconfig, kubectl).get("nvidia.com/gpu") == str(FAKE_GPUS), sup)
    log(f"node {NODE_NAME} Ready at {NODE_IP} in {time.monotonic() - t0:.1f}s")


def advertise_fake_devices(bins: Path, kubeconfig: Path, kubectl: Callable[..., str], rdma: bool) -> None:
    """The documented way to advertise extended resources without a device plugin: patch the node
    status; the kubelet then keeps them and mirrors them into allocatable."""
    capacity: dict[str, str | None] = {"nvidia.com/gpu": str(FAKE_GPUS),
                                       RDMA_RESOURCE: str(RDMA_COUNT) if rdma else None}
    kubectl(bins, kubeconfig, "patch", "node", NODE_NAME, "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": {"capacity": capacity}}))


def allocatable(bins: Path, kubeconfig: Path, kubectl: Callable[..., str]) -> dict[str, str]:
    node = json.loads(kubectl(bins, kubeconfig, "get", "node", NODE_NAME, "-o", "json"))
    return dict(node["status"].get("allocatable", {}))


# --- stop ---------------------------------------------------------------------------------

def remove_containers(paths: Paths) -> None:
    """Kill and delete every container and sandbox (their snapshots go with them). The kubelet is
    stopped by then, so nothing restarts them."""
    if not paths.socket.exists():
        return
    tasks = ctr(paths, "tasks", "ls", "-q", check=False).stdout.decode().split()
    for task in tasks:
        ctr(paths, "tasks", "kill", "--signal", "SIGKILL", task, check=False)
    for task in tasks:
        ctr(paths, "tasks", "delete", "--force", task, check=False)
    for container in ctr(paths, "containers", "ls", "-q", check=False).stdout.decode().split():
        ctr(paths, "containers", "delete", container, check=False)


def our_processes(paths: Paths) -> list[int]:
    """Processes whose command line names our containerd socket: the runc shims, which containerd
    starts in sessions of their own so that they outlive it."""
    marker = str(paths.socket).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


def mounts_under(prefixes: list[str]) -> list[str]:
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == p or point.startswith(p.rstrip("/") + "/") for p in prefixes):
            found.append(point)
    return found


def unmount_all(prefixes: list[str]) -> None:
    # Deepest first; lazily if still busy (a process we could not see holds it).
    for point in sorted(set(mounts_under(prefixes)), key=lambda p: -p.count("/")):
        if run("umount", point, check=False).returncode != 0:
            run("umount", "-l", point, check=False)


def delete_links() -> None:
    for link in (POD_BRIDGE, NODE_LINK):
        if link_exists(link):
            run("ip", "link", "delete", link, check=False)
    # Host ends of pod veth pairs whose namespace outlived its pod: gone once the bridge is, but a
    # veth still enslaved elsewhere would show in `leftovers`.


def remove_iptables_chains(baseline: dict) -> None:  # type: ignore[type-arg]
    """Delete the KUBE-* and CNI-* chains the kubelet and kube-proxy added, and the rules that jump
    to them from the built-in chains; rules that were there before `up` stay."""
    for tool in IPTABLES:
        if shutil.which(f"{tool}-save") is None:
            continue
        before = set(baseline.get("iptables", {}).get(tool, []))
        table = ""
        for line in run(f"{tool}-save", check=False).stdout.decode(errors="replace").splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith("-A ") and line not in before and _mentions_our_chain(line):
                # shlex: the kubelet's and kube-proxy's rules carry quoted comments.
                run(tool, "-t", table, "-D", *shlex.split(line)[1:], check=False)
        for table_name, chain in _our_chains(tool):
            run(tool, "-t", table_name, "-F", chain, check=False)
        for table_name, chain in _our_chains(tool):
            run(tool, "-t", table_name, "-X", chain, check=False)


def _mentions_our_chain(rule: str) -> bool:
    """An `-A CHAIN ...` rule in one of our chains or jumping to one."""
    words = rule.split()
    return bool(OUR_CHAIN.match(words[1])) or any(
        w in ("-j", "-g") and i + 1 < len(words) and OUR_CHAIN.match(words[i + 1]) for i, w in enumerate(words))


def _is_ours(line: str) -> bool:
    """A line of iptables_rules(): our chain's declaration (`:KUBE-X -`) or a rule of ours."""
    if line.startswith(":"):
        return bool(OUR_CHAIN.match(line[1:]))
    return _mentions_our_chain(line)


def _our_chains(tool: str) -> list[tuple[str, str]]:
    chains, table = [], ""
    for line in run(f"{tool}-save", check=False).stdout.decode(errors="replace").splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(":") and OUR_CHAIN.match(line[1:]):
            chains.append((table, line[1:].split()[0]))
    return chains


def cgroup_hierarchies() -> list[Path]:
    """Mount points of every cgroup hierarchy (v1 controllers, name=systemd, the unified one)."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        fstype = fields[fields.index("-") + 1]
        if fstype in ("cgroup", "cgroup2"):
            points.append(Path(fields[4]))
    return points


def kubelet_cgroups() -> list[Path]:
    """The kubelet's `kubepods` tree in each hierarchy, and nothing else (not the machine's own)."""
    return [h / "kubepods" for h in cgroup_hierarchies() if (h / "kubepods").is_dir()]


def remove_cgroups() -> None:
    for top in kubelet_cgroups():
        # Children first: a cgroup directory can be removed only once it has none (and no tasks).
        for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
            for _ in range(20):
                try:
                    os.rmdir(dirpath)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)  # the kernel is still tearing down a killed task


def restore_sysctls(baseline: dict) -> None:  # type: ignore[type-arg]
    for name, value in baseline.get("sysctls", {}).items():
        with contextlib.suppress(OSError):
            if sysctl_path(name).read_text().strip() != value:
                sysctl_path(name).write_text(value + "\n")


def remove_host_paths(baseline: dict, state: Path) -> None:  # type: ignore[type-arg]
    existed = set(baseline.get("existing_paths", []))
    for path in HOST_PATHS:
        if path not in existed and os.path.lexists(path):
            shutil.rmtree(path, ignore_errors=True)
    # Folders that existed before may still hold our entries: log links into our state, CNI caches.
    with contextlib.suppress(OSError):
        for link in Path("/var/log/containers").iterdir():
            if link.is_symlink() and str(state) in os.readlink(link):
                link.unlink()
    with contextlib.suppress(OSError):
        for cached in Path("/var/lib/cni/results").glob(f"{CNI_NETWORK}-*"):
            cached.unlink()


def stop(state: Path, pids: dict[str, int], stop_pid: Callable[[str, int], None]) -> None:
    """Tear the node down; `pids` are those hack/cluster.py recorded (the node's are removed from it)."""
    paths = Paths(state)
    baseline = load_baseline(paths)
    for name in ("kube-proxy", "kubelet"):
        if name in pids:
            stop_pid(name, pids.pop(name))
    remove_containers(paths)
    if "containerd" in pids:
        stop_pid("containerd", pids.pop("containerd"))
    for pid in our_processes(paths):
        stop_pid("containerd-shim", pid)
    unmount_all([str(paths.node)])
    delete_links()
    remove_iptables_chains(baseline)
    remove_cgroups()
    restore_sysctls(baseline)
    remove_host_paths(baseline, state)
    run("conntrack", "-D", "-s", POD_SUBNET, check=False)  # stale NAT entries of pod flows


def leftovers(state: Path, baseline: dict | None = None) -> list[str]:  # type: ignore[type-arg]
    """Everything of a real node still on this machine; empty after a clean `down`."""
    paths = Paths(state)
    baseline = baseline if baseline is not None else load_baseline(paths)
    found = [f"process {pid}" for pid in our_processes(paths)]
    found += [f"mount {m}" for m in mounts_under([str(paths.node), "/run/containerd", "/var/run/netns"])]
    found += [f"link {link}" for link in (NODE_LINK, POD_BRIDGE) if link_exists(link)]
    veths = run("ip", "-j", "link", "show", "master", POD_BRIDGE, check=False).stdout
    if veths.strip() and veths.strip() != b"[]":
        found.append("veths still on the pod bridge")
    for tool, rules in iptables_rules().items():
        before = set(baseline.get("iptables", {}).get(tool, []))
        found += [f"{tool}: {r}" for r in rules if r not in before and _is_ours(r)]
    found += [f"cgroup {c}" for c in kubelet_cgroups()]
    existed = set(baseline.get("existing_paths", []))
    found += [f"path {p}" for p in HOST_PATHS if p not in existed and os.path.lexists(p)]
    before_sysctls = baseline.get("sysctls", {})
    found += [f"sysctl {k}={v} (was {before_sysctls[k]})" for k, v in read_sysctls().items()
              if k in before_sysctls and before_sysctls[k] != v]
    return found
