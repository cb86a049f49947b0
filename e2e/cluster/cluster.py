"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, controller manager, scheduler,
kwok for fake GPU nodes, and the runner that plays kubelet for one local node.

Why real binaries: the operator is tested against the same API semantics (admission, RBAC,
garbage collection, scheduling, Deployments → ReplicaSets → Pods) it meets on a real cluster.
Everything listens on 127.0.0.1 with ports the kernel picks, lives under one state directory, and
is stopped by `stop()` (also run at interpreter exit) without leaving processes behind.
"""

from __future__ import annotations

import atexit
import json
import os
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from . import procs
from .binaries import ensure_binaries
from .pki import Pki, make_pki, write_kubeconfig

# Pods get this venv's bin/ first on PATH (so `anneal …` and `python -m anneal…` work): ANNEAL_VENV,
# else the venv running this code, else the project's usual venv.
DEFAULT_VENV = Path(os.environ.get("ANNEAL_VENV") or
                    (sys.prefix if sys.prefix != sys.base_prefix else "/root/.cache/anneal/venv"))
LOCAL_NODE = "anneal-local"
GPU_NODE_PREFIX = "kwok-gpu-"
SERVICE_CIDR = "10.0.0.0/24"


class ClusterError(RuntimeError):
    """A component failed to start or to become healthy; the message names its log file."""


class ToolError(subprocess.CalledProcessError):
    """kubectl/helm failed; the message carries what it printed on stderr."""

    def __str__(self) -> str:
        return f"{' '.join(map(str, self.cmd))} exited {self.returncode}: {self.stderr.strip()}"


class LocalCluster:
    """One control plane. `start()` brings it up, `stop()` tears it down; usable as a context manager.

    `state_dir` holds certificates, data, logs and `state.json` (so `down` can find a cluster that
    `up` started from another process).
    """

    def __init__(self, state_dir: Path, gpu_nodes: int = 2, gpus_per_node: int = 8,
                 venv: Path | None = None, runner: bool = True, tie_to_parent: bool = True) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.gpu_nodes = gpu_nodes
        self.gpus_per_node = gpus_per_node
        self.venv = Path(venv) if venv else DEFAULT_VENV
        self.with_runner = runner
        self.tie_to_parent = tie_to_parent  # components die with this process (False for `up`)
        self.cluster_id = uuid.uuid4().hex[:12]
        self.bin_dir: Path | None = None
        self.pki: Pki | None = None
        self.kubeconfig = self.state_dir / "kubeconfig"
        self.server = ""
        self.pgids: dict[str, int] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self.startup_seconds = 0.0

    # ---------------------------------------------------------------- lifecycle

    def start(self, timeout: float = 180.0) -> "LocalCluster":
        t0 = time.monotonic()
        self.bin_dir = ensure_binaries()
        if self.state_dir.exists() and (self.state_dir / "state.json").exists():
            raise ClusterError(f"{self.state_dir} already holds a cluster; run `e2e/cluster/down` first")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        try:
            self.pki = make_pki(self.state_dir / "pki")
            self._start_etcd(timeout)
            self._start_apiserver(timeout)
            self._save_state()
            self._start("kube-controller-manager", self._controller_manager_args())
            self._start("kube-scheduler", self._scheduler_args())
            self._save_state()
            self._wait_for(lambda: self._kubectl_ok("get", "serviceaccount", "default", "-n", "default"),
                           "the controller manager to create the default service account", timeout, "kube-controller-manager")
            if self.gpu_nodes:
                from .kwok import start_kwok
                start_kwok(self, timeout)
            if self.with_runner:
                self._start_runner(timeout)
            self._save_state()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Stop the runner first (it kills its pods), then the rest in reverse order, then sweep."""
        order = ["runner", "kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"]
        for name in order + [n for n in self.pgids if n not in order]:
            pgid = self.pgids.pop(name, None)
            if pgid is not None:
                procs.kill_group(pgid, grace=10.0 if name == "runner" else 5.0)
            p = self._procs.pop(name, None)
            if p is not None:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        procs.sweep(self.cluster_id)
        state = self.state_dir / "state.json"
        if state.exists():
            state.unlink()
        try:
            atexit.unregister(self.stop)
        except Exception:
            pass

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @classmethod
    def from_state(cls, state_dir: Path) -> "LocalCluster":
        """Re-attach to a cluster that `up` started (for `down`)."""
        data = json.loads((Path(state_dir) / "state.json").read_text())
        c = cls(Path(state_dir), venv=Path(data["venv"]))
        c.cluster_id = data["cluster_id"]
        c.pgids = {k: int(v) for k, v in data["pgids"].items()}
        c.server = data["server"]
        c.bin_dir = Path(data["bin_dir"])
        return c

    # ---------------------------------------------------------------- clients

    def kubectl(self, *args: str, input: str | None = None, check: bool = False,
                timeout: float = 120) -> subprocess.CompletedProcess:
        """Run kubectl against this cluster; returns the CompletedProcess (text mode)."""
        return self._run_tool("kubectl", args, input, check, timeout)

    def helm(self, *args: str, input: str | None = None, check: bool = False,
             timeout: float = 300) -> subprocess.CompletedProcess:
        return self._run_tool("helm", args, input, check, timeout)

    def api(self):
        """A kubernetes python ApiClient for the admin user."""
        from kubernetes import config
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def service_url(self, name: str, namespace: str = "default", port: int | str | None = None,
                    scheme: str = "http", timeout: float = 60.0) -> str:
        """`scheme://<pod ip>:<port>` of a ready endpoint of Service `name` (see services.py)."""
        from .services import resolve_service
        ip, p = resolve_service(self, name, namespace, port, timeout)
        return f"{scheme}://{ip}:{p}"

    def pod_log(self, namespace: str, name: str, container: str | None = None) -> str:
        """What a runner pod's container printed (there is no kubelet behind `kubectl logs`)."""
        d = self.state_dir / "runner" / "pods" / f"{namespace}_{name}"
        logs = sorted(d.glob("*.log")) if container is None else [d / f"{container}.log"]
        return "".join(p.read_text(errors="replace") for p in logs if p.exists())

    def env(self) -> dict[str, str]:
        """Environment for tools run against this cluster (KUBECONFIG, the binaries on PATH)."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        env["HELM_CACHE_HOME"] = str(self.state_dir / "helm" / "cache")
        env["HELM_CONFIG_HOME"] = str(self.state_dir / "helm" / "config")
        env["HELM_DATA_HOME"] = str(self.state_dir / "helm" / "data")
        return env

    def _run_tool(self, tool, args, input, check, timeout) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(self.bin_dir / tool), *map(str, args)], input=input,
                              capture_output=True, text=True, env=self.env(), timeout=timeout)
        if check and proc.returncode != 0:
            raise ToolError(proc.returncode, proc.args, proc.stdout, proc.stderr)
        return proc

    def _kubectl_ok(self, *args: str) -> bool:
        return self.kubectl(*args, timeout=30).returncode == 0

    # ---------------------------------------------------------------- components

    def _component_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG",)}
        env[procs.MARKER] = self.cluster_id
        return env

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        p = procs.spawn(argv, self.log(name), env or self._component_env(), cwd=self.state_dir,
                        tie_to_parent=self.tie_to_parent)
        self._procs[name] = p
        self.pgids[name] = p.pid  # a new session: its pgid is its pid
        return p

    def log(self, name: str) -> Path:
        return self.state_dir / "logs" / f"{name}.log"

    def _wait_for(self, ok, what: str, timeout: float, component: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p = self._procs.get(component)
            if p is not None and p.poll() is not None:
                raise ClusterError(f"{component} exited with {p.returncode} while waiting for {what}; "
                                   f"see {self.log(component)}:\n{_tail(self.log(component))}")
            try:
                if ok():
                    return
            except Exception:
                pass
            time.sleep(0.3)
        raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}; see {self.log(component)}:\n"
                           f"{_tail(self.log(component))}")

    def _start_etcd(self, timeout: float) -> None:
        client, peer = procs.free_port(), procs.free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._start("etcd", [
            str(self.bin_dir / "etcd"), "--name=default", f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync=true", "--log-level=warn",
        ])
        self._wait_for(lambda: _http_ok(f"{self.etcd_url}/health"), "etcd /health", timeout, "etcd")

    def _start_apiserver(self, timeout: float) -> None:
        port = procs.free_port()
        self.server = f"https://127.0.0.1:{port}"
        pki = self.pki
        self._start("kube-apiserver", [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1", f"--secure-port={port}", "--advertise-address=127.0.0.1",
            f"--cert-dir={self.state_dir / 'apiserver-certs'}",
            f"--tls-cert-file={pki.serving_crt}", f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_crt}",
            # No front proxy: a CA for its headers, and a name no certificate carries.
            f"--requestheader-client-ca-file={pki.ca_crt}", "--requestheader-allowed-names=anneal-no-front-proxy",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--authorization-mode=RBAC",
            # GPU nodes carry the nvidia.com/gpu:NoSchedule taint; this plugin gives pods that
            # request nvidia.com/gpu the matching toleration, as on managed GPU clusters.
            "--enable-admission-plugins=ExtendedResourceToleration",
            "--allow-privileged=true",
            # `kubectl logs` goes through the runner's kubelet log API on 127.0.0.1.
            f"--kubelet-client-certificate={pki.admin_crt}", f"--kubelet-client-key={pki.admin_key}",
            f"--kubelet-certificate-authority={pki.ca_crt}", "--kubelet-preferred-address-types=InternalIP",
            # Loopback addresses are not valid Endpoints, so the apiserver publishes none for itself.
            "--endpoint-reconciler-type=none",
            "--v=1",
        ])
        write_kubeconfig(self.kubeconfig, self.server, pki)
        self._wait_for(lambda: _https_ok(f"{self.server}/readyz", pki), "kube-apiserver /readyz",
                       timeout, "kube-apiserver")

    def _controller_manager_args(self) -> list[str]:
        kc, pki = str(self.kubeconfig), self.pki
        return [
            str(self.bin_dir / "kube-controller-manager"),
            f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1", f"--secure-port={procs.free_port()}",
            f"--cert-dir={self.state_dir / 'kcm-certs'}",
            "--leader-elect=false",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca_crt}",
            f"--cluster-signing-cert-file={pki.ca_crt}", f"--cluster-signing-key-file={pki.ca_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # Pod IPs on loopback are not valid endpoint addresses: the runner publishes EndpointSlices.
            "--controllers=*,-endpoints-controller,-endpointslice-controller",
            "--v=1",
        ]

    def _scheduler_args(self) -> list[str]:
        kc = str(self.kubeconfig)
        return [
            str(self.bin_dir / "kube-scheduler"),
            f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1", f"--secure-port={procs.free_port()}",
            f"--cert-dir={self.state_dir / 'scheduler-certs'}",
            "--leader-elect=false", "--v=1",
        ]

    def _start_runner(self, timeout: float) -> None:
        env = self._component_env()
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        python = self.venv / "bin" / "python"
        if not python.exists():
            python = Path(sys.executable)
        self._start("runner", [
            str(python), "-m", "cluster.runner", f"--kubeconfig={self.kubeconfig}",
            f"--node={LOCAL_NODE}", f"--state-dir={self.state_dir / 'runner'}",
            f"--venv={self.venv}", f"--server={self.server}",
            f"--tls-cert={self.pki.serving_crt}", f"--tls-key={self.pki.serving_key}", f"--client-ca={self.pki.ca_crt}",
        ], env=env)
        self._wait_for(lambda: self._node_ready(LOCAL_NODE), f"node {LOCAL_NODE} to be Ready",
                       timeout, "runner")

    def _node_ready(self, name: str) -> bool:
        out = self.kubectl("get", "node", name, "-o",
                           "jsonpath={.status.conditions[?(@.type=='Ready')].status}", timeout=30)
        return out.returncode == 0 and out.stdout.strip() == "True"

    def _save_state(self) -> None:
        (self.state_dir / "state.json").write_text(json.dumps({
            "cluster_id": self.cluster_id, "pgids": self.pgids, "server": self.server,
            "kubeconfig": str(self.kubeconfig), "bin_dir": str(self.bin_dir), "venv": str(self.venv),
        }, indent=2))


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status == 200


def _https_ok(url: str, pki: Pki) -> bool:
    ctx = ssl.create_default_context(cafile=str(pki.ca_crt))
    ctx.load_cert_chain(str(pki.admin_crt), str(pki.admin_key))
    with urllib.request.urlopen(url, timeout=2, context=ctx) as r:
        return r.status == 200
