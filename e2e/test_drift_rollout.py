"""Issue 8 end to end: traffic drift -> CompilationJob -> verified plan -> canary -> promoted; then a
planted bad plan is rolled back; the load generator counts zero failed requests throughout.

Real parts: the local control plane (e2e/cluster), the chart installed by helm, two `anneal serve
--model random:tiny` replicas running as processes on the runner node, a real Prometheus (Debian
package) scraping them, the operator's own CompilationJob running the real `anneal compile` on two
CPU engine pods. Prometheus finds the replicas through a file_sd target list this test keeps up to
date from the pods (what kubernetes_sd + relabelling does in a cluster: `namespace` and `pod`
labels). The load generator sends OpenAI completions to the ready replicas: short `chat`-like
prompts, then long `agentic`-like prompts.

The planted bad plan arrives the way a user's plan does: a CompilationJob with autoApply (mode
auto: it goes through the canary) whose coordinator is a stand-in publishing the serving plan with
scheduler knobs that are verified (outputs unchanged) but wrong for agentic traffic: one sequence
at a time, a 16-token step budget and no prefix cache, so every ~1000-token prompt is recomputed
16 tokens a step behind the request before it. The canary's time to first token is then many times
its peers' (`max_num_seqs: 1` alone was not enough: with ~2 requests in flight per replica it
added about one request's time, ~3x the stable TTFT, right at the gate's limit then; its ITL and
throughput were no worse, since one sequence per step is not slower on the CPU).
"""

from __future__ import annotations

import functools
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from anneal.engine.plan import Plan, SchedulerKnobs, load_plan
from cluster import operator_chart as chart
from cluster.waiting import wait_for as _wait_for

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the shared test helpers (not a package)
from prometheus_server import PROMETHEUS, running_prometheus  # noqa: E402

pytestmark = pytest.mark.e2e
OPERATOR_NS = "anneal-system"
NS = "anneal-drift"
NAME = "tiny"


wait_for = functools.partial(_wait_for, every=1.0)  # Prometheus windows: no need to poll faster


def get(c, kind, name, ns=NS):
    out = c.kubectl("get", kind, name, "-n", ns, "-o", "json")
    return json.loads(out.stdout) if out.returncode == 0 else None


def status(c, kind="infdep", name=NAME):
    return (get(c, kind, name) or {}).get("status") or {}


def apply(c, *objs):
    out = c.kubectl("apply", "-n", NS, "-f", "-", input="\n---\n".join(yaml.safe_dump(o) for o in objs))
    assert out.returncode == 0, out.stderr


def events(c, name=NAME):
    out = c.kubectl("get", "events", "-n", NS, "--field-selector", f"involvedObject.name={name}", "-o", "json")
    return [(e.get("type"), e.get("reason"), e.get("message")) for e in json.loads(out.stdout)["items"]]


def engine_pods(c) -> list[dict]:
    out = c.kubectl("get", "pods", "-n", NS, "-l", f"app.kubernetes.io/name=anneal-engine,anneal.dev/inference-deployment={NAME}",
                    "-o", "json")
    if out.returncode != 0:
        return []
    return [p for p in json.loads(out.stdout)["items"] if not p["metadata"].get("deletionTimestamp")]


def _ready(p) -> bool:
    return any(x["type"] == "Ready" and x["status"] == "True" for x in p.get("status", {}).get("conditions") or [])


class Discovery(threading.Thread):
    """Keeps Prometheus' file_sd list and the load generator's endpoints equal to the ready replicas."""

    def __init__(self, c, path: Path):
        super().__init__(daemon=True)
        self.c, self.path, self.stop = c, path, threading.Event()
        self.endpoints: list[tuple[str, str]] = []  # (pod, ip)
        self.write([])

    def write(self, pods):
        targets = [{"targets": [f"{ip}:8000"], "labels": {"namespace": NS, "pod": name}} for name, ip in pods]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(targets))
        os.replace(tmp, self.path)

    def run(self):
        while not self.stop.is_set():
            try:
                pods = sorted((p["metadata"]["name"], p["status"]["podIP"]) for p in engine_pods(self.c)
                              if _ready(p) and p.get("status", {}).get("podIP"))
                if pods != self.endpoints:
                    self.write(pods)
                    self.endpoints = pods
            except Exception as err:  # noqa: BLE001 - keep discovering
                print("discovery:", err)
            time.sleep(1)


class LoadGenerator:
    """Closed-loop OpenAI completion clients over the ready replicas; counts every failure."""

    def __init__(self, discovery: Discovery, workers: int = 4):
        self.discovery, self.workers = discovery, workers
        self.phase = "chat"
        self.stop = threading.Event()
        self.ok = 0
        self.failed: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.work, args=(i,), daemon=True) for i in range(workers)]

    def request(self, rng: random.Random) -> tuple[str, int]:
        if self.phase == "chat":
            return " ".join("hi" for _ in range(rng.randint(8, 24))), rng.randint(8, 16)
        return " ".join("context" for _ in range(rng.randint(90, 160))), rng.randint(24, 40)  # ~700-1300 tokens

    def work(self, i: int):
        rng = random.Random(i)
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                eps = list(self.discovery.endpoints)
                if not eps:
                    time.sleep(0.5)
                    continue
                pod, ip = rng.choice(eps)
                prompt, max_tokens = self.request(rng)
                try:
                    r = client.post(f"http://{ip}:8000/v1/completions",
                                    json={"model": "random:tiny", "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0, "ignore_eos": True})
                    good = r.status_code == 200 and r.json()["choices"][0]["text"] is not None
                    why = f"{pod}: HTTP {r.status_code} {r.text[:200]}"
                except Exception as err:  # noqa: BLE001 - every failure is counted
                    good, why = False, f"{pod}: {type(err).__name__}: {err}"
                with self.lock:
                    if good:
                        self.ok += 1
                    else:
                        self.failed.append(why)

    def start(self):
        for t in self.threads:
            t.start()

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)


@pytest.fixture(scope="module")
def stack(cluster, tmp_path_factory):
    if PROMETHEUS is None:
        pytest.skip("the `prometheus` binary is not installed (Debian: apt-get install -y prometheus)")
    tmp = tmp_path_factory.mktemp("drift-prom")
    targets = tmp / "targets.json"
    discovery = Discovery(cluster, targets)
    with running_prometheus(tmp, [], file_sd=targets, job_name="anneal-engines") as url:
        out = cluster.helm(
            "upgrade", "--install", "anneal", str(REPO / "charts" / "anneal"), "-n", OPERATOR_NS, "--create-namespace",
            "--set-string", "operator.nodeSelector.anneal\\.dev/local-exec=true",
            "--set", "operator.reconcileInterval=2", "--set", "operator.logLevel=DEBUG",
            "--set-string", f"prometheus.url={url}",
            "--wait", "--timeout", "180s",
        )
        assert out.returncode == 0, out.stdout + out.stderr
        cluster.kubectl("create", "namespace", NS)
        discovery.start()
        try:
            yield cluster, discovery, url
        finally:
            discovery.stop.set()
            pods = cluster.kubectl("get", "pods", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/name=anneal-operator",
                                   "-o", "jsonpath={.items[0].metadata.name}").stdout
            if pods:
                print(cluster.pod_log(OPERATOR_NS, pods)[-30000:])
            cluster.kubectl("delete", "namespace", NS, "--wait=false")  # stop the engines for later modules
            # later modules share the cluster: wait for the namespace to go (the operator releases its
            # finalizers), then uninstall the operator so no controller rewrites what they create
            chart.uninstall_operator(cluster, namespaces=(NS,))


def inference_deployment() -> dict:
    return {
        "apiVersion": "anneal.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": NAME},
        "spec": {
            "model": "random:tiny", "replicas": 2, "gpus": 0,
            # the plan it serves was tuned for light chat traffic: two sequences at a time
            "plan": {"inline": {"scheduler": {"max_num_seqs": 2}}},
            "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}},
            # replicas are processes on one host here: each binds its own pod IP, not 0.0.0.0
            "serving": {"extraArgs": ["--host", "$(POD_IP)"]},
            "compilation": {
                "mode": "auto",
                "prometheus": {"window": "20s"},
                "drift": {"threshold": 1.0, "consecutiveWindows": 2, "minRequests": 20, "checkInterval": "5s",
                          "cooldown": "1h", "maxStaleness": "2m"},
                "search": {"budget": "40s", "fastLayers": 1, "agents": ["scheduler-tuner", "graph-buckets"]},
                # latency gates at 5x the stable replicas': the compiled plan admits more sequences a
                # step than the served max_num_seqs 2, and on two CPU cores that alone moved its TTFT
                # p90 to 3.15x its peers' in one CI run (0.725 s against 0.23 s, session 21) while the
                # planted bad plan reads ~16x (3.55 s against 0.222 s)
                "rollout": {"canary": {"initialDelay": "20s", "interval": "10s", "iterations": 3, "failureLimit": 1,
                                       "maxLatencyRegression": 4.0, "minThroughputRatio": 0.3,
                                       "maxErrorRateIncrease": 0.01}},
            },
        },
    }


def served_hashes(discovery: Discovery) -> dict[str, str | None]:
    out = {}
    for pod, ip in discovery.endpoints:
        try:
            out[pod] = httpx.get(f"http://{ip}:8000/health", timeout=5).json().get("plan_hash")
        except httpx.HTTPError:
            out[pod] = None
    return out


BAD_COORDINATOR = r'''
import os, json
from anneal.engine.plan import CompiledPlan, Gain, Plan
from anneal.operator import progress
ns, name = progress.parse_report_to(os.environ["REPORT_TO"])
plan = Plan.model_validate_json(os.environ["PLAN"])
# like the real coordinator: start once the job's two engines are ready
import time
from kubernetes import client
from anneal.operator.kube import load_config
core = client.CoreV1Api(load_config())
def ready(t):
    try:
        p = core.read_namespaced_pod(f"{name}-{t}", ns)
    except client.ApiException:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
deadline = time.time() + 300
while not (ready("fast") and ready("slow")):
    if time.time() > deadline:
        raise SystemExit("engines never became ready")
    time.sleep(1)
progress.report(ns, name, phase="Searching", experiments=1, strict=True)
compiled = CompiledPlan(plan=plan, model="random:tiny", hardware="cpu",
                        gains=[Gain(metric="tokens_per_s", baseline=100.0, candidate=150.0)],
                        verification={"passed": True})
progress.publish_result(ns, name, compiled)
progress.report(ns, name, phase="Done", experiments=1, best_speedup=1.5, strict=True)
'''


def test_drift_compiles_canaries_promotes_then_rolls_back_a_bad_plan(stack):
    c, discovery, prom_url = stack
    apply(c, inference_deployment())
    wait_for(lambda: status(c).get("phase") == "Ready", 300, "the deployment Ready")
    wait_for(lambda: len(discovery.endpoints) == 2, 120, "two ready replicas discovered")
    first_hash = status(c)["planHash"]
    load = LoadGenerator(discovery)
    load.start()
    timeline: list[str] = []

    def note(what):
        st = status(c)
        line = (f"{time.strftime('%H:%M:%S')} {what}: drift={st.get('drift', {}).get('score')} "
                f"rollout={st.get('rollout', {}).get('state')} ok={load.ok} failed={len(load.failed)}")
        timeline.append(line)
        print(line)

    try:
        # 1. chat traffic: a baseline, within policy
        st = wait_for(lambda: (s := status(c)).get("drift", {}).get("score") is not None and s, 240,
                      "a drift score for the chat baseline")
        assert st["drift"]["baseline"].startswith("first observed window"), st["drift"]
        assert st["drift"]["score"] < 1.0 and "within policy" in st["drift"]["message"], st["drift"]
        note("baseline")
        # 2. shift to agentic: drift detected, exactly one CompilationJob
        load.phase = "agentic"
        st = wait_for(lambda: (s := status(c)).get("drift", {}).get("compilationJob") and s, 300, "drift -> CompilationJob")
        job = st["drift"]["compilationJob"]
        note(f"drift triggered {job}")
        assert st["drift"]["parts"]["promptLength"] >= 1.0, st["drift"]
        assert ("Warning", "DriftDetected") in [e[:2] for e in events(c)]
        jobs = json.loads(c.kubectl("get", "cjob", "-n", NS, "-o", "json").stdout)["items"]
        assert [j["metadata"]["name"] for j in jobs] == [job]
        assert jobs[0]["spec"]["traffic"]["shape"]["name"].startswith("observed:")
        # the rollout follows the job; still one job while it runs
        wait_for(lambda: status(c).get("rollout", {}).get("state") in ("Compiling", "Verifying"), 120, "rollout Compiling")
        cj = wait_for(lambda: (s := status(c, "cjob", job)).get("phase") in ("Succeeded", "Failed") and s, 900,
                      "the compilation finished")
        note(f"compilation {cj['phase']}")
        assert cj["phase"] == "Succeeded", cj
        assert len(json.loads(c.kubectl("get", "cjob", "-n", NS, "-o", "json").stdout)["items"]) == 1
        new_hash = cj["resultPlanHash"]
        assert new_hash != first_hash, "the compiler returned the serving plan: nothing to roll out"
        # 3. canary on ONE replica, in place, then promoted
        st = wait_for(lambda: (s := status(c)).get("rollout", {}).get("state") == "Canary"
                      and s["rollout"].get("canarySince") and s, 180, "canary serving")
        canary = st["rollout"]["canaryPod"]
        hashes = served_hashes(discovery)
        assert hashes[canary] == new_hash and sorted(hashes.values()) == sorted([new_hash, first_hash]), hashes
        note(f"canary {canary}")
        st = wait_for(lambda: (s := status(c)).get("rollout", {}).get("state") in ("Succeeded", "RolledBack", "Failed")
                      and s, 400, "the rollout finished", every=2)
        note("rollout finished")
        print("good rollout:", st["rollout"]["message"], [(g["name"], g["outcome"], g.get("message")) for g in st["rollout"]["gates"]])
        assert st["rollout"]["state"] == "Succeeded", st["rollout"]
        assert st["rollout"]["analysesPassed"] == 3 and st["planHash"] == new_hash
        assert set(served_hashes(discovery).values()) == {new_hash}
        pods_before = {p["metadata"]["name"] for p in engine_pods(c)}
        assert canary in pods_before  # promoted in place: no replica restarted
        ev = [e[1] for e in events(c)]
        for reason in ("CanaryStarted", "CanaryServing", "CanaryPassed", "RolloutSucceeded"):
            assert reason in ev, ev
        cols = c.kubectl("get", "infdep", NAME, "-n", NS).stdout
        assert new_hash in cols and "Succeeded" in cols, cols

        # 4. a planted bad plan: verified (same outputs), but its scheduler is wrong for this traffic:
        # requests serialised, prompts prefilled 16 tokens a step, the shared context never cached
        current = load_plan(get(c, "configmap", f"{NAME}-plan")["data"]["plan.json"])
        knobs = SchedulerKnobs(max_num_seqs=1, max_num_batched_tokens=16, chunked_prefill=True,
                               enable_prefix_caching=False)
        bad = Plan.model_validate(json.loads(current.model_copy(update={"scheduler": knobs}).model_dump_json()))
        assert bad.hash != new_hash
        apply(c, {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "planted-coordinator"},
                  "spec": {"backoffLimit": 0, "template": {"spec": {
                      "serviceAccountName": "planted-coordinator", "restartPolicy": "Never",
                      "containers": [{"name": "coordinator", "image": "unused", "command": ["python", "-c", BAD_COORDINATOR],
                                      "env": [{"name": "REPORT_TO", "value": f"{NS}/planted"},
                                              {"name": "PLAN", "value": bad.model_dump_json()}]}]}}}},
              {"apiVersion": "anneal.dev/v1alpha1", "kind": "CompilationJob", "metadata": {"name": "planted"},
               "spec": {"target": {"inferenceDeployment": NAME}, "budget": "10s", "retries": 0, "autoApply": True,
                        "agents": ["scheduler-tuner"], "tiers": {"fastLayers": 1}}})
        st = wait_for(lambda: (s := status(c)).get("rollout", {}).get("toPlanHash") == bad.hash
                      and s["rollout"]["state"] == "Canary" and s, 300, "the bad plan's canary")
        note("bad canary")
        st = wait_for(lambda: (s := status(c)).get("rollout", {}).get("state") in ("Succeeded", "RolledBack", "Failed")
                      and s, 400, "the bad rollout finished", every=2)
        note("bad rollout finished")
        ro = st["rollout"]
        print("bad rollout:", ro["message"], [(g["name"], g["outcome"], g.get("message")) for g in ro["gates"]])
        assert ro["state"] == "RolledBack", ro
        assert bad.hash in ro["rejectedPlans"] and ro["analysesFailed"] >= 1
        # rejected for what the plan breaks: the canary's time to first token against its peers'
        assert {g["name"]: g["outcome"] for g in ro["gates"]}.get("ttft-p90") == "fail", ro["gates"]
        assert st["planHash"] == new_hash and set(served_hashes(discovery).values()) == {new_hash}
        ev = [e[:2] for e in events(c)]
        assert ("Warning", "CanaryAnalysisFailed") in ev and ("Warning", "RolledBack") in ev, ev
        time.sleep(10)
        assert status(c)["rollout"]["state"] == "RolledBack"  # never retried
    finally:
        load.close()
        print("\n".join(timeline))
        print(f"load: {load.ok} ok, {len(load.failed)} failed; first failures: {load.failed[:5]}")
    # 5. the load generator saw zero failed requests throughout
    assert load.ok > 100 and load.failed == [], load.failed[:10]
