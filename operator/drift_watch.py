"""Drift watch: a kopf timer per InferenceDeployment that reads the served traffic from
Prometheus, decides with the deployment's drift policy (`anneal.operator.drift`), writes the
score, its parts and the reason into ``status.drift``, and on sustained drift creates exactly one
CompilationJob for the observed shape.

- Every ``drift.checkInterval`` one window of ``prometheus.window`` is read for the deployment's
  pods (``namespace`` and ``pod`` labels, plus ``prometheus.selector``). Observations are kept in
  memory, bounded; an operator restart starts a new streak (the cooldown survives: it is in status).
- The baseline (the traffic the serving plan was compiled for): the serving CompiledPlan's traffic,
  else the policy's ``traffic`` preset, else the first usable window observed under that plan.
- Never two compilations at once for one deployment: no job while any CompilationJob targeting it
  is unfinished or a rollout is in progress; ``paused`` and ``pinnedPlan`` report instead of
  compiling; ``mode: off`` does not watch; ``mode: preview`` compiles (the rollout reports).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import kopf
from pydantic import ValidationError

from anneal.engine.plan import CompiledPlan, Plan, default_plan
from anneal.engine.traffic import TrafficShape, parse_traffic, preset
from anneal.operator import drift, naming, plan_source
from anneal.operator.api import GROUP, VERSION
from anneal.operator.api import compilation_job as cj_api
from anneal.operator.api import inference_deployment as api
from anneal.operator.api.base import duration_seconds
from anneal.operator.context import Context
from anneal.operator.engine_pod import engine_device
from anneal.operator.kube import ApiException, api_message
from anneal.operator.rollout import ACTIVE, iso, parse_iso
from anneal.operator.traffic_reader import Prometheus, PrometheusQueryError, TrafficObservation

LABEL_TRIGGER = "anneal.dev/trigger"
LABEL_DRIFT_OF = "anneal.dev/drift-of"  # not the deployment's own label: job children must never match its selectors
HISTORY = 64  # observations kept per deployment
_UNMEASURABLE_WEIGHT = 1e-12


def policy_for(spec: api.InferenceDeploymentSpec) -> drift.DriftPolicy:
    """The CRD's drift policy as `drift.DriftPolicy`: a part's scale is its default unit divided by
    its weight (weight 2 = counts twice; 0 = ignored); the minimum window is the Prometheus window
    (every read covers exactly that window)."""
    d = spec.compilation.drift
    base = drift.DriftScales()
    names = {v: k for k, v in drift.STATUS_PART_NAMES.items()}
    scales = {}
    for part, weight in d.weights.items():
        field = names[part]
        scales[field] = getattr(base, field) / max(weight, _UNMEASURABLE_WEIGHT)
    window = duration_seconds(spec.compilation.prometheus.window)
    return drift.DriftPolicy(
        enter_threshold=d.threshold,
        exit_threshold=d.exit_threshold if d.exit_threshold is not None else 0.7 * d.threshold,
        consecutive_windows=d.consecutive_windows,
        min_requests=max(1, d.min_requests),
        min_window_seconds=window,
        cooldown_seconds=duration_seconds(d.cooldown),
        max_staleness_seconds=max(duration_seconds(d.max_staleness), 2 * duration_seconds(d.check_interval)),
        scales=drift.DriftScales(**{**base.model_dump(), **scales}),
    )


def pod_selector(name: str, namespace: str, extra: str = "") -> str:
    """The deployment's pods in Prometheus: Deployment pods are named <name>-<hash>-<suffix>."""
    matchers = [f'namespace="{namespace}"', f'pod=~"{name}-[a-z0-9]+-[a-z0-9]+"']
    extra = extra.strip().removeprefix("{").removesuffix("}").strip()
    if extra:
        matchers.append(extra)
    return ",".join(matchers)


def job_name(name: str, now: float) -> str:
    digits, n = "0123456789abcdefghijklmnopqrstuvwxyz", int(now)
    out = ""
    while n:
        n, r = divmod(n, 36)
        out = digits[r] + out
    return f"{name[:26]}-drift-{out or '0'}"


def compilation_job(name: str, namespace: str, spec: api.InferenceDeploymentSpec, shape: TrafficShape,
                    job: str, serving: Plan | None = None) -> dict[str, Any]:
    """The CompilationJob drift asks for: this deployment, the observed shape (or the policy's
    preset), the policy's search and verification, seeded with the plan it serves (unless that is
    the device's default plan, which the job's engines start from anyway); never autoApply (the
    rollout decides)."""
    policy = spec.compilation
    traffic: dict[str, Any] = {"preset": policy.traffic} if policy.traffic else {"shape": shape.model_dump(mode="json")}
    body: dict[str, Any] = {
        "target": {"inferenceDeployment": name},
        "traffic": traffic,
        "budget": policy.search.budget,
        "tiers": {"fastLayers": policy.search.fast_layers},
        "agents": list(policy.search.agents),
        "verification": policy.verification.wire(),
        "autoApply": False,
    }
    if policy.search.llm_credentials is not None:
        body["llm"] = {"credentials": policy.search.llm_credentials.wire()}
    default = default_plan(engine_device(spec.serving, spec.gpus))  # what the job's tier engines start on
    if serving is not None and serving.hash != default.hash:
        body["seedPlans"] = [{"inline": serving.model_dump(mode="json")}]
    cj_api.CompilationJobSpec.model_validate(body)  # the job we create must pass our own models
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": cj_api.KIND,
        "metadata": {"name": job, "namespace": namespace,
                     "labels": {LABEL_DRIFT_OF: name, LABEL_TRIGGER: "drift"}},
        "spec": body,
    }


def blocker(name: str, cp: api.CompilationPolicy, status: dict[str, Any], jobs: list[dict[str, Any]]) -> str | None:
    """Why a triggered drift must not compile now (None: compile). `jobs`: the namespace's
    CompilationJobs; any unfinished one targeting this deployment blocks (never two at once)."""
    if cp.paused:
        return "paused"
    if cp.pinned_plan is not None:
        return "pinnedPlan is set"
    rollout = (status.get("rollout") or {}).get("state")
    if rollout in ACTIVE:
        return f"a rollout is in progress ({rollout})"
    for job in jobs:
        target = ((job.get("spec") or {}).get("target") or {}).get("inferenceDeployment")
        phase = (job.get("status") or {}).get("phase") or "Pending"
        if target == name and phase not in cj_api.TERMINAL_PHASES and not job["metadata"].get("deletionTimestamp"):
            return f"CompilationJob {job['metadata']['name']} is {phase}"
    return None


class DriftWatch:
    """Per-deployment memory (observation history, last read) and the timer's body."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._lock = threading.Lock()
        self._history: dict[str, collections.deque[TrafficObservation]] = {}
        self._baseline_key: dict[str, str] = {}
        self._last_read: dict[str, float] = {}

    def forget(self, uid: str) -> None:
        with self._lock:
            for d in (self._history, self._baseline_key, self._last_read):
                d.pop(uid, None)

    # -- baseline ------------------------------------------------------------------------------

    def baseline(self, name: str, namespace: str, spec: api.InferenceDeploymentSpec, status: dict[str, Any],
                 history: list[TrafficObservation], policy: drift.DriftPolicy) -> tuple[TrafficShape | None, str]:
        configured = status.get("planHash")
        d = status.get("drift") or {}
        if d.get("compiled") and d.get("compiledPlanHash") == configured and d.get("baseline"):
            return TrafficShape.model_validate(d["compiled"]), d["baseline"]
        source = status.get("planSource") or ""
        if source.startswith("CompilationJob/"):
            found = self.ctx.kube.config_map(namespace, naming.compiled_plan_config_map(name))
            if found and naming.PLAN_KEY in found[0]:
                try:
                    compiled = CompiledPlan.model_validate_json(found[0][naming.PLAN_KEY])
                    if compiled.traffic:
                        return parse_traffic(compiled.traffic, source="compiled plan traffic"), f"{source} (CompiledPlan)"
                except (ValidationError, ValueError):
                    pass
        if spec.compilation.traffic:
            return preset(spec.compilation.traffic), f"preset {spec.compilation.traffic}"
        for obs in sorted(history, key=lambda o: o.at):
            if obs.shape is not None and obs.requests >= policy.min_requests:
                return obs.shape, f"first observed window ({iso(obs.at)})"
        return None, ""

    # -- the timer -----------------------------------------------------------------------------

    def tick(self, body: kopf.Body, patch: kopf.Patch, logger: Any, now: float | None = None) -> None:
        name, ns, uid = body.metadata.name, body.metadata.namespace, body.metadata.uid
        status = dict(body.get("status") or {})
        previous = dict(status.get("drift") or {})
        try:
            spec = api.InferenceDeploymentSpec.model_validate(dict(body.spec))
        except ValidationError:
            return  # the deployment reconcile reports the invalid spec
        cp = spec.compilation
        now = time.time() if now is None else now
        if cp.mode == "off":
            if previous:  # switched off: say so instead of leaving a stale score
                self._write(body, patch, previous, {"message": "mode off: traffic drift is not watched"})
            return
        url = cp.prometheus.url or self.ctx.settings.prometheus_url
        if not url:
            self._write(body, patch, previous, {
                "message": "no Prometheus URL: set spec.compilation.prometheus.url or the operator's prometheus.url"})
            return
        with self._lock:
            last = self._last_read.get(uid)
        if last is not None and now - last < duration_seconds(cp.drift.check_interval):
            return
        policy = policy_for(spec)
        window = duration_seconds(cp.prometheus.window)
        try:
            with Prometheus(url) as prom:
                obs = prom.read_traffic(pod_selector(name, ns, cp.prometheus.selector), window, at=now)
        except PrometheusQueryError as err:
            self._write(body, patch, previous, {"message": f"bad Prometheus query (check prometheus.selector): {err}"[:1000]})
            return
        with self._lock:
            self._last_read[uid] = now
            history = self._history.setdefault(uid, collections.deque(maxlen=HISTORY))
            history.append(obs)
            snapshot = list(history)

        base, base_source = self.baseline(name, ns, spec, status, snapshot, policy)
        key = f"{status.get('planHash')}|{base_source}"
        with self._lock:
            if self._baseline_key.get(uid) not in (None, key):
                # the serving plan changed: windows scored against the old one are no evidence now
                self._history[uid] = collections.deque([obs], maxlen=HISTORY)
                snapshot = [obs]
            self._baseline_key[uid] = key
        new: dict[str, Any] = {
            "requests": int(obs.requests),
            "observedAt": iso(obs.at),
            "observed": obs.shape.model_dump(mode="json") if obs.shape else None,
            "compilationJob": previous.get("compilationJob"),
            "lastCompilationAt": previous.get("lastCompilationAt"),
        }
        if base is None:
            new["message"] = f"no baseline yet: {obs.reason or 'waiting for a window with enough requests'}"
            self._write(body, patch, previous, new)
            return
        new.update(compiled=base.model_dump(mode="json"), compiledPlanHash=status.get("planHash"), baseline=base_source)
        decision = drift.decide(base, snapshot, policy, now, parse_iso(previous.get("lastCompilationAt")))
        new.update(
            score=None if decision.score is None else round(decision.score, 4),
            parts=drift.status_parts(decision.parts),
            dominant=decision.dominant,
            streak=decision.streak,
            windowsNeeded=decision.windows_needed,
            message=decision.reason,
        )
        if decision.trigger:
            blocker = self._blocker(name, ns, cp, status)
            if blocker:
                new["message"] = f"{decision.reason}; not compiling: {blocker}"
            else:
                latest = next(o for o in sorted(snapshot, key=lambda o: -o.at) if o.shape is not None)
                job = compilation_job(name, ns, spec, latest.shape, job_name(name, now), self._serving(name, ns, spec))
                kopf.adopt(job, owner=body)
                try:
                    _, created = self.ctx.kube.create_if_absent(job)
                except ApiException as exc:
                    new["message"] = f"{decision.reason}; cannot create CompilationJob: {api_message(exc)}"[:1000]
                    if previous.get("message") != new["message"]:
                        kopf.warn(body, reason="CompilationNotCreated", message=new["message"])
                    self._write(body, patch, previous, new)
                    return
                new.update(compilationJob=job["metadata"]["name"], lastCompilationAt=iso(now),
                           message=f"{decision.reason}; compiling: CompilationJob {job['metadata']['name']}")
                if created:
                    kopf.warn(body, reason="DriftDetected", message=decision.reason)
                    kopf.info(body, reason="CompilationStarted",
                              message=f"CompilationJob {job['metadata']['name']} for the observed traffic")
                    logger.info("drift: created CompilationJob %s", job["metadata"]["name"])
        self._write(body, patch, previous, new)

    def _serving(self, name: str, ns: str, spec: api.InferenceDeploymentSpec) -> Plan | None:
        """The plan the deployment serves, to seed its recompile (None when it cannot be read: the
        deployment's own handler reports that)."""
        try:
            return plan_source.resolve(name, spec, lambda cm: self.ctx.kube.config_map(ns, cm)).plan
        except (plan_source.PlanError, ValidationError):
            return None

    def _blocker(self, name: str, ns: str, cp: api.CompilationPolicy, status: dict[str, Any]) -> str | None:
        quick = blocker(name, cp, status, [])
        if quick:
            return quick
        return blocker(name, cp, status, self.ctx.kube.list(f"{GROUP}/{VERSION}", cj_api.KIND, ns))

    @staticmethod
    def _write(body: kopf.Body, patch: kopf.Patch, previous: dict[str, Any], new: dict[str, Any]) -> None:
        merged = {k: v for k, v in {**previous, **new}.items() if v is not None}
        api.DriftStatus.model_validate(merged)  # what we write must match the CRD's schema
        if merged != previous:
            # a merge patch: keys we dropped must be nulled explicitly
            patch.status["drift"] = {**{k: None for k in previous if k not in merged}, **merged}


def register(registry: kopf.OperatorRegistry, ctx: Context) -> DriftWatch:
    watch = DriftWatch(ctx)
    kw: dict[str, Any] = dict(group=GROUP, version=VERSION, plural=api.PLURAL, registry=registry)

    @kopf.timer(**kw, interval=ctx.settings.reconcile_interval, initial_delay=ctx.settings.reconcile_interval)
    def watch_traffic_drift(body: kopf.Body, patch: kopf.Patch, logger: Any, **_: Any) -> None:
        """Level-triggered: read the traffic, score the drift, compile once when it is sustained."""
        watch.tick(body, patch, logger)

    @kopf.on.delete(**kw, optional=True)
    def forget_traffic_history(body: kopf.Body, **_: Any) -> None:
        """Drop the in-memory history of a deleted deployment (no finalizer needed)."""
        watch.forget(body.metadata.uid)

    return watch
