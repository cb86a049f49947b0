"""The local runner: plays kubelet for one node, running its pods' containers as local processes.

Why: the e2e suite needs pods that really run (the operator, engines, coordinator jobs) without a
container runtime. The runner registers node `anneal-local` (label `anneal.dev/local-exec=true`),
keeps its lease fresh, and for each pod bound to it:
- gives it its own loopback IP (127.N.x.y, N claimed per cluster; 127.0.0.1 with hostNetwork) as pod IP: programs must bind to $(POD_IP) or 0.0.0.0
  (binding 0.0.0.0 takes the port on every pod IP, so two such pods cannot share a port);
- runs each container's command + args (the image is ignored) in its own process group, with the
  pod's env (downward API, ConfigMap/Secret refs) and its volumes as local directories (podspec.py);
- reports phase, pod IP, container statuses, restarts (restartPolicy, back-off 1 s doubling to
  10 s) and readiness (readinessProbe; livenessProbe failures restart the container);
- publishes the EndpointSlices of every Service (the controller manager's endpoint controllers are
  off): the API server refuses loopback IPs as IPv4 endpoint addresses, so local pods go into
  `<svc>-local` with `addressType: FQDN` and the IP text as address; kwok pods into `<svc>-nodes`;
- refreshes mounted ConfigMap/Secret files every few seconds, as the kubelet does;
- runs startupProbe before readiness/liveness; FallbackToLogsOnError puts the log tail in the message;
- ignores images, securityContext (runs as the runner's user) and resource limits;
- on deletion, SIGTERMs the process groups (SIGKILL after the grace period, at most 10 s) and
  removes the pod with grace period 0.
Logs: `<state dir>/pods/<namespace>_<name>/<container>.log`, also served to `kubectl logs` (logserver.py).
"""

from __future__ import annotations

import argparse
import fcntl
import datetime as dt
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from . import procs
from .logserver import LogServer
from .podspec import ConfigError, PodContext, base_env
from .probes import ProbeState, run_probe
from .rest import ApiError, Rest

log = logging.getLogger("runner")
MANAGER = "runner.anneal.dev"
LABEL = "anneal.dev/local-exec"
VOLUME_REFRESH_S = 3.0  # mounted ConfigMaps and Secrets follow their objects this fast


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


BLOCK_DIR = Path(os.environ.get("ANNEAL_IP_BLOCK_DIR", "/tmp/anneal-e2e-ip-blocks"))


def claim_block(block_dir: Path = BLOCK_DIR) -> tuple[int, object]:
    """A /16 of loopback (127.N, N in 1…254) that no other live cluster on this machine uses.

    Several clusters may run at once (parallel test sessions, a test that starts its own); each
    runner holds an flock on `127.N.lock` for its whole life, and the kernel drops it when the
    runner dies. Returns N and the open lock file (keep it referenced)."""
    block_dir.mkdir(parents=True, exist_ok=True)
    for n in range(1, 255):
        f = open(block_dir / f"127.{n}.lock", "w")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        f.write(f"{os.getpid()}\n")
        f.flush()
        return n, f
    raise RuntimeError(f"all 254 loopback blocks in {block_dir} are held by running clusters")


class IpPool:
    """Loopback pod IPs 127.N.0.2 … 127.N.255.254, handed out in order and reused after release."""

    def __init__(self, block: int = 1) -> None:
        if not 1 <= block <= 254:
            raise ValueError(f"loopback block {block} is not in 1…254 (127.0 holds the control plane)")
        self.block = block
        self._lock = threading.Lock()
        self._used: set[str] = set()
        self._next = 2

    def take(self) -> str:
        with self._lock:
            for _ in range(65534):
                n, self._next = self._next, self._next + 1 if self._next < 65534 else 2
                ip = f"127.{self.block}.{n // 256}.{n % 256}"
                if n % 256 not in (0, 255) and ip not in self._used:
                    self._used.add(ip)
                    return ip
        raise RuntimeError("no free loopback pod IP")

    def release(self, ip: str) -> None:
        with self._lock:
            self._used.discard(ip)


class Container:
    """One container's process and the status the kubelet would report for it."""

    def __init__(self, spec: dict, init: bool) -> None:
        self.spec, self.name, self.init = spec, spec["name"], init
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.state: dict = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict = {}
        self.next_start = 0.0
        self.done = False
        self.ready = False
        self.readiness: ProbeState | None = None
        self.liveness: ProbeState | None = None
        self.startup: ProbeState | None = None
        self.started_ok = False  # the startupProbe passed (or there is none)
        self.env: dict[str, str] = {}
        self.cwd = ""

    def status(self) -> dict:
        ready = self.ready if not self.init else bool(self.done and self.exit_code() == 0)
        return {"name": self.name, "image": self.spec.get("image", ""), "imageID": "",
                "containerID": f"anneal-local://{self.proc.pid}" if self.proc else "",
                "ready": ready, "restartCount": self.restarts, "started": "running" in self.state and self.started_ok,
                "state": self.state, "lastState": self.last_state}

    def exit_code(self) -> int | None:
        return self.state.get("terminated", {}).get("exitCode")


class PodWorker(threading.Thread):
    """Runs one pod: prepare, start containers, probe, restart, report; stop on deletion."""

    def __init__(self, runner: "Runner", pod: dict) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.runner, self.pod = runner, pod
        self.uid, self.ns, self.pod_name = meta["uid"], meta["namespace"], meta["name"]
        self.host_network = bool(pod["spec"].get("hostNetwork"))
        self.ip = "127.0.0.1" if self.host_network else runner.ips.take()
        self.dir = runner.state_dir / "pods" / f"{self.ns}_{self.pod_name}"
        if self.dir.exists():  # an earlier pod of the same name: its logs and volumes are not ours
            shutil.rmtree(self.dir, ignore_errors=True)
        self.stop_event = threading.Event()
        self.deleted = False  # the pod is being deleted through the API
        self.vanished = False  # the pod is gone from the API (or the runner is stopping)
        self.inits = [Container(c, True) for c in pod["spec"].get("initContainers", [])]
        self.mains = [Container(c, False) for c in pod["spec"]["containers"]]
        self.ctx: PodContext | None = None
        self.config_error = ""
        self.start_time = now_iso()
        self.phase = "Pending"
        self.transitions: dict[str, tuple[str, str]] = {}
        self._last_report: str = ""
        self.next_refresh = time.monotonic() + VOLUME_REFRESH_S

    # -------------------------------------------------------------- lifecycle

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                if self.deleted or self.vanished:
                    break
                self.step()
                self.report()
                self.stop_event.wait(0.2)
        except Exception:
            log.exception("pod worker %s/%s failed", self.ns, self.pod_name)
        finally:
            self.kill_all(self._grace())
            if self.deleted and not self.vanished:
                self.runner.delete_pod(self.ns, self.pod_name, self.uid)
            if not self.host_network:
                self.runner.ips.release(self.ip)
            self.runner.forget(self.uid)

    def _grace(self) -> float:
        if self.runner.stopping:
            return 5.0
        g = self.pod["metadata"].get("deletionGracePeriodSeconds",
                                     self.pod["spec"].get("terminationGracePeriodSeconds", 30))
        return float(min(max(g or 0, 0.5), 10))

    def kill_all(self, grace: float) -> None:
        live = [c.proc for c in self.inits + self.mains if c.proc and c.proc.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(procs.group_alive(p.pid) for p in live):
            time.sleep(0.05)
        for p in live:
            procs.kill_group(p.pid, grace=0)
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass

    # -------------------------------------------------------------- the loop

    def prepare(self) -> bool:
        """Lay out the pod's directory and volumes; False (with a reason) while something is missing."""
        if self.ctx is not None:
            return True
        ctx = PodContext(self.pod, self.dir, self.ip, self.runner.rest.get, self.request_token,
                         self.runner.server, base_env(self.runner.venv, self.dir, (procs.MARKER, self.runner.cluster_id)))
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            ctx.materialize_volumes()
            ctx.finish_service_account()
        except (ConfigError, ApiError) as e:
            self.config_error = str(e)
            return False
        self.ctx, self.config_error = ctx, ""
        return True

    def request_token(self, src: dict) -> str:
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"audiences": [src["audience"]] if src.get("audience") else None,
                         "expirationSeconds": max(int(src.get("expirationSeconds", 3607)), 86400),
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.pod_name,
                                            "uid": self.uid}}}
        out = self.runner.rest.create(f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token", body)
        return out["status"]["token"]

    def step(self) -> None:
        if self.phase in ("Succeeded", "Failed"):
            return
        if self.ctx is not None and time.monotonic() >= self.next_refresh:
            self.next_refresh = time.monotonic() + VOLUME_REFRESH_S
            try:
                self.ctx.materialize_volumes(refresh=True)
            except (ConfigError, ApiError) as e:
                log.warning("%s/%s: volume refresh: %s", self.ns, self.pod_name, e)
        if not self.prepare():
            for c in self.inits + self.mains:
                c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": self.config_error}}
            return
        policy = self.pod["spec"].get("restartPolicy", "Always")
        for c in self.inits:
            if c.done:
                continue
            self.drive(c, "Never" if policy == "Never" else "OnFailure")
            if c.done and c.exit_code() != 0:
                self.phase = "Failed"
                return
            if not c.done:
                return  # init containers run one at a time, in order
        for c in self.mains:
            self.drive(c, policy)
        if all(c.done for c in self.mains):
            self.phase = "Succeeded" if all(c.exit_code() == 0 for c in self.mains) else "Failed"
        elif any("running" in c.state or c.restarts for c in self.mains):
            self.phase = "Running"

    def drive(self, c: Container, policy: str) -> None:
        now = time.monotonic()
        if c.proc is not None and c.proc.poll() is not None:
            self.exited(c, policy, now)
        if c.proc is None and not c.done and now >= c.next_start:
            self.launch(c)
        if c.proc is not None and c.proc.poll() is None and not c.init:
            self.probe(c, now)

    def launch(self, c: Container) -> None:
        ctx = self.ctx
        try:
            mounts = ctx.mounts(c.spec)
            c.env = ctx.env(c.spec, mounts)
            argv = ctx.argv(c.spec, c.env, mounts)
            c.cwd = str(ctx.workdir(c.spec, mounts))
        except ConfigError as e:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
            c.next_start = time.monotonic() + 2
            return
        logf = self.dir / f"{c.name}.log"
        try:
            with open(logf, "ab") as out:
                c.proc = subprocess.Popen(argv, env=c.env, cwd=c.cwd, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=procs.die_with_parent)
        except OSError as e:
            c.state = {"waiting": {"reason": "RunContainerError", "message": f"{argv[0]}: {e}"}}
            c.restarts += 1
            c.next_start = time.monotonic() + self._backoff(c)
            return
        log.info("%s/%s: started %s (pid %d, ip %s)", self.ns, self.pod_name, c.name, c.proc.pid, self.ip)
        c.state = {"running": {"startedAt": now_iso()}}
        c.ready = False
        c.startup = ProbeState(c.spec["startupProbe"]) if c.spec.get("startupProbe") else None
        c.started_ok = c.startup is None
        self._arm_probes(c)

    @staticmethod
    def _arm_probes(c: Container) -> None:
        """Readiness and liveness count from the moment the container has started."""
        c.readiness = ProbeState(c.spec["readinessProbe"]) if c.spec.get("readinessProbe") else None
        c.liveness = ProbeState(c.spec["livenessProbe"]) if c.spec.get("livenessProbe") else None

    def exited(self, c: Container, policy: str, now: float) -> None:
        code = c.proc.returncode
        code = 128 - code if code < 0 else code  # killed by a signal: 128 + signal number, as kubelet shows
        started = c.state.get("running", {}).get("startedAt", now_iso())
        c.state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                  "startedAt": started, "finishedAt": now_iso(),
                                  "containerID": f"anneal-local://{c.proc.pid}"}}
        if code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            c.state["terminated"]["message"] = self._log_tail(c)
        log.info("%s/%s: %s exited with %d", self.ns, self.pod_name, c.name, code)
        c.ready = False
        restart = policy == "Always" or (policy == "OnFailure" and code != 0)
        if not restart:
            c.done = True
            return
        c.last_state = c.state
        c.restarts += 1
        c.proc = None
        c.next_start = now + self._backoff(c)
        c.state = {"waiting": {"reason": "CrashLoopBackOff",
                               "message": f"back-off restarting failed container {c.name}"}}

    def _log_tail(self, c: Container) -> str:
        """What the kubelet puts in the message for FallbackToLogsOnError: the last 80 lines, 2 KiB."""
        try:
            data = (self.dir / f"{c.name}.log").read_bytes()
        except OSError:
            return ""
        return b"".join(data.splitlines(keepends=True)[-80:])[-2048:].decode(errors="replace")

    @staticmethod
    def _backoff(c: Container) -> float:
        return min(10.0, 2.0 ** max(c.restarts - 1, 0))

    def probe(self, c: Container, now: float) -> None:
        if not c.started_ok:
            if c.startup.due(now):
                ok, msg = run_probe(c.startup.probe, c.spec, self.ip, c.env, c.cwd)
                c.startup.record(ok, time.monotonic())
                if ok:
                    c.started_ok = True
                    self._arm_probes(c)
                elif c.startup.failures >= int(c.startup.probe.get("failureThreshold", 3)):
                    log.info("%s/%s: %s failed its startup probe (%s), restarting", self.ns, self.pod_name, c.name, msg)
                    procs.kill_group(c.proc.pid, grace=2)
            return
        if c.readiness is None:
            c.ready = True
        elif c.readiness.due(now):
            ok, _ = run_probe(c.readiness.probe, c.spec, self.ip, c.env, c.cwd)
            c.ready = c.readiness.record(ok, time.monotonic())
        if c.liveness is not None and c.liveness.due(now):
            ok, msg = run_probe(c.liveness.probe, c.spec, self.ip, c.env, c.cwd)
            c.liveness.record(ok, time.monotonic())
            if c.liveness.failures >= int(c.liveness.probe.get("failureThreshold", 3)):
                log.info("%s/%s: %s failed liveness (%s), restarting", self.ns, self.pod_name, c.name, msg)
                procs.kill_group(c.proc.pid, grace=2)

    # -------------------------------------------------------------- status

    def _condition(self, ctype: str, ok: bool) -> dict:
        status = "True" if ok else "False"
        prev = self.transitions.get(ctype)
        if prev is None or prev[0] != status:
            self.transitions[ctype] = (status, now_iso())
        return {"type": ctype, "status": status, "lastProbeTime": None,
                "lastTransitionTime": self.transitions[ctype][1]}

    def status(self) -> dict:
        inits_done = all(c.done and c.exit_code() == 0 for c in self.inits)
        ready = (self.phase == "Running" and inits_done and all(c.ready for c in self.mains))
        mine = {"PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready"}
        conds = [self._condition("PodReadyToStartContainers", self.ctx is not None),
                 self._condition("Initialized", inits_done),
                 self._condition("ContainersReady", ready),
                 self._condition("Ready", ready)]
        conds += [c for c in self.pod.get("status", {}).get("conditions", []) if c["type"] not in mine]
        st = {"phase": self.phase, "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
              "podIP": self.ip, "podIPs": [{"ip": self.ip}], "startTime": self.start_time,
              "conditions": conds, "qosClass": self.pod.get("status", {}).get("qosClass", "BestEffort"),
              "containerStatuses": [c.status() for c in self.mains]}
        if self.inits:
            st["initContainerStatuses"] = [c.status() for c in self.inits]
        return st

    def report(self) -> None:
        st = self.status()
        key = json.dumps(st, sort_keys=True)
        if key == self._last_report:
            return
        try:
            self.runner.rest.merge_patch(f"/api/v1/namespaces/{self.ns}/pods/{self.pod_name}/status",
                                         {"metadata": {"uid": self.uid}, "status": st})
            self._last_report = key
        except ApiError as e:
            if e.status in (404, 409):
                self.vanished = e.status == 404
            else:
                log.warning("status of %s/%s: %s", self.ns, self.pod_name, e)

    def endpoint_ready(self) -> bool:
        return self.phase == "Running" and all(c.ready for c in self.mains)


class Runner:
    def __init__(self, rest: Rest, node: str, state_dir: Path, venv: Path, server: str,
                 logs: LogServer | None = None) -> None:
        self.rest, self.node, self.state_dir, self.venv, self.server = rest, node, state_dir, venv, server
        self.logs = logs
        self.cluster_id = os.environ.get(procs.MARKER, "")
        self.block, self._block_lock = claim_block()
        self.ips = IpPool(self.block)
        self.workers: dict[str, PodWorker] = {}
        self._lock = threading.Lock()
        self.stopping = False
        self._slices: dict[str, str] = {}

    # -------------------------------------------------------------- node

    def register_node(self) -> None:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node, "labels": {
            LABEL: "true", "kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64", "anneal.dev/node-type": "local"}}}
        try:
            self.rest.create("/api/v1/nodes", node)
        except ApiError as e:
            if e.status != 409:
                raise
            self.rest.merge_patch(f"/api/v1/nodes/{self.node}", {"metadata": node["metadata"]})
        self.node_status()

    def node_status(self) -> None:
        t = now_iso()
        conds = [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                  "message": "anneal local runner is posting ready status"}]
        conds += [{"type": k, "status": "False", "reason": f"KubeletHas{r}"} for k, r in
                  (("MemoryPressure", "SufficientMemory"), ("DiskPressure", "NoDiskPressure"),
                   ("PIDPressure", "SufficientPID"))]
        for c in conds:
            c.update(lastHeartbeatTime=t, lastTransitionTime=t)
        capacity = {"cpu": "32", "memory": "256Gi", "pods": "250", "ephemeral-storage": "500Gi"}
        self.rest.merge_patch(f"/api/v1/nodes/{self.node}/status", {"status": {
            "capacity": capacity, "allocatable": capacity, "conditions": conds,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": self.node}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.logs.port if self.logs else 0}},
            "nodeInfo": {"kubeletVersion": "anneal-local-runner", "operatingSystem": "linux",
                         "architecture": "amd64", "containerRuntimeVersion": "local-process://1",
                         "kernelVersion": os.uname().release, "osImage": "local", "kubeProxyVersion": "",
                         "machineID": "", "systemUUID": "", "bootID": ""}}})

    def renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node}"
        self.rest.apply(path, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                               "metadata": {"name": self.node, "namespace": "kube-node-lease"},
                               "spec": {"holderIdentity": self.node, "leaseDurationSeconds": 40,
                                        "renewTime": micro_now()}}, MANAGER)

    def heartbeat(self) -> None:
        n = 0
        while not self.stopping:
            try:
                self.renew_lease()
                if n % 3 == 0:
                    self.node_status()
            except Exception as e:  # the API server may be restarting; keep trying
                log.warning("heartbeat: %s", e)
            n += 1
            for _ in range(100):
                if self.stopping:
                    return
                time.sleep(0.1)

    # -------------------------------------------------------------- pods

    def running(self, ns: str, name: str) -> bool:
        """True while a worker runs pod ns/name (for `kubectl logs -f`)."""
        with self._lock:
            return any(w.ns == ns and w.pod_name == name and not (w.deleted or w.vanished)
                       for w in self.workers.values())

    def forget(self, uid: str) -> None:
        with self._lock:
            self.workers.pop(uid, None)

    def delete_pod(self, ns: str, name: str, uid: str) -> None:
        try:
            self.rest.delete(f"/api/v1/namespaces/{ns}/pods/{name}",
                             {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}})
            log.info("%s/%s: deleted", ns, name)
        except ApiError as e:
            if e.status not in (404, 409):
                log.warning("delete %s/%s: %s", ns, name, e)

    def sync(self) -> list[dict]:
        pods = self.rest.get("/api/v1/pods", fieldSelector=f"spec.nodeName={self.node}")["items"]
        seen = set()
        for pod in pods:
            meta = pod["metadata"]
            uid = meta["uid"]
            seen.add(uid)
            with self._lock:
                w = self.workers.get(uid)
            if w is not None:
                w.pod = pod
                if meta.get("deletionTimestamp"):
                    w.deleted = True
                continue
            if meta.get("deletionTimestamp"):
                self.delete_pod(meta["namespace"], meta["name"], uid)
                continue
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                continue
            w = PodWorker(self, pod)
            with self._lock:
                self.workers[uid] = w
            w.start()
        with self._lock:
            gone = [w for uid, w in self.workers.items() if uid not in seen]
        for w in gone:
            w.vanished = True
        return pods

    # -------------------------------------------------------------- services

    def publish_endpoints(self) -> None:
        """EndpointSlices for every Service with a selector (the controller manager's endpoint
        controllers are off: they cannot write loopback addresses). Pods of this node go into
        `<svc>-local` (addressType FQDN, the loopback IP as text); pods of other (kwok) nodes into
        `<svc>-nodes` (IPv4), as the real controller would write them."""
        services = [s for s in self.rest.get("/api/v1/services")["items"] if s["spec"].get("selector")]
        if not services and not self._slices:
            return
        pods = self.rest.get("/api/v1/pods")["items"]
        with self._lock:
            workers = {w.uid: w for w in self.workers.values()}
        for svc in services:
            ns, sel = svc["metadata"]["namespace"], svc["spec"]["selector"]
            matching = [p for p in pods if p["metadata"]["namespace"] == ns
                        and all(p["metadata"].get("labels", {}).get(k) == v for k, v in sel.items())
                        and p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]
            local, remote = [], []
            for p in matching:
                terminating = bool(p["metadata"].get("deletionTimestamp"))
                w = workers.get(p["metadata"]["uid"])
                if p["spec"].get("nodeName") == self.node:
                    if w is None:
                        continue
                    ip, serving = w.ip, w.endpoint_ready()
                    bucket = local
                else:
                    ip = p.get("status", {}).get("podIP")
                    if not ip:
                        continue
                    serving = any(c["type"] == "Ready" and c["status"] == "True"
                                  for c in p["status"].get("conditions", []))
                    bucket = remote
                bucket.append({"addresses": [ip], "nodeName": p["spec"].get("nodeName"),
                               "conditions": {"ready": serving and not terminating, "serving": serving,
                                              "terminating": terminating},
                               "targetRef": {"kind": "Pod", "namespace": ns, "name": p["metadata"]["name"],
                                             "uid": p["metadata"]["uid"]}})
            ports = []
            for sp in svc["spec"].get("ports", []):
                number = self._target_port(sp.get("targetPort", sp["port"]), matching)
                if number is not None:
                    ports.append({"name": sp.get("name", ""), "port": number, "protocol": sp.get("protocol", "TCP")})
            self._publish(svc, "local", "FQDN", local, ports)
            self._publish(svc, "nodes", "IPv4", remote, ports)

    def _publish(self, svc: dict, suffix: str, address_type: str, endpoints: list, ports: list) -> None:
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        slice_name = f"{name}-{suffix}"
        key = f"{ns}/{slice_name}/{svc['metadata']['uid']}"
        if not endpoints and key not in self._slices:
            return
        body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": slice_name, "namespace": ns,
                             "labels": {"kubernetes.io/service-name": name,
                                        "endpointslice.kubernetes.io/managed-by": MANAGER},
                             "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": name,
                                                  "uid": svc["metadata"]["uid"], "controller": True,
                                                  "blockOwnerDeletion": True}]},
                "addressType": address_type, "endpoints": endpoints, "ports": ports}
        digest = json.dumps(body, sort_keys=True)
        if self._slices.get(key) == digest:
            return
        try:
            self.rest.apply(f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices/{slice_name}", body, MANAGER)
            self._slices[key] = digest
        except ApiError as e:
            log.warning("endpointslice %s: %s", key, e)

    @staticmethod
    def _target_port(target, pods: list[dict]) -> int | None:
        if isinstance(target, int) or str(target).isdigit():
            return int(target)
        for p in pods:
            for c in p["spec"]["containers"]:
                for port in c.get("ports", []):
                    if port.get("name") == target:
                        return int(port["containerPort"])
        return None

    # -------------------------------------------------------------- main

    def run(self, period: float = 0.5) -> None:
        if self.logs:
            self.logs.start()
        self.register_node()
        threading.Thread(target=self.heartbeat, name="heartbeat", daemon=True).start()
        log.info("node %s registered; pod IPs from 127.%d.0.0/16", self.node, self.block)
        while not self.stopping:
            try:
                self.sync()
                self.publish_endpoints()
            except Exception as e:
                log.warning("sync: %s", e)
            time.sleep(period)

    def shutdown(self) -> None:
        self.stopping = True
        with self._lock:
            workers = list(self.workers.values())
        for w in workers:
            w.vanished = True
        for w in workers:
            w.join(timeout=15)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kubeconfig", required=True, type=Path)
    ap.add_argument("--node", default="anneal-local")
    ap.add_argument("--state-dir", required=True, type=Path)
    ap.add_argument("--venv", type=Path, default=Path(os.environ.get("ANNEAL_VENV", "/root/.cache/anneal/venv")))
    ap.add_argument("--server", help="API server URL given to pods (default: the kubeconfig's)")
    ap.add_argument("--tls-cert", help="serving certificate for the kubelet log API (with --tls-key, --client-ca)")
    ap.add_argument("--tls-key")
    ap.add_argument("--client-ca")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    rest = Rest(args.kubeconfig)
    runner = Runner(rest, args.node, args.state_dir, args.venv, args.server or rest.server)
    if args.tls_cert:
        runner.logs = LogServer(args.state_dir / "pods", args.tls_cert, args.tls_key, args.client_ca, runner.running)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    loop = threading.Thread(target=runner.run, name="sync", daemon=True)
    loop.start()
    while not stop.is_set() and loop.is_alive():
        stop.wait(0.5)
    log.info("stopping: killing pod processes")
    runner.shutdown()
    if not stop.is_set():
        raise SystemExit("the sync loop died; see the traceback above")


if __name__ == "__main__":
    main()
