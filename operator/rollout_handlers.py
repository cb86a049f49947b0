"""kopf timer that moves an InferenceDeployment's plan rollout along: observe (pods and the plan
hash each engine serves, the proposal, the drift job, canary gates when due), `rollout.step`, then
carry out its intents (PUT /admin/plan on one pod, accept a plan) and post its events.

Proposals that roll out by themselves: the plan of the CompilationJob drift started
(``status.drift.compilationJob``), and that of a job the user created with ``autoApply`` while
the deployment's mode is ``auto`` with a Canary strategy (see `compilation_handlers.apply_result`).
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from typing import Any

import kopf
from pydantic import ValidationError

from anneal.engine.plan import load_plan
from anneal.operator import canary_gates, engine_admin, naming, plan_source, rollout
from anneal.operator.api import GROUP, VERSION
from anneal.operator.api import compilation_job as cj_api
from anneal.operator.api import inference_deployment as api
from anneal.operator.api.base import duration_seconds
from anneal.operator.compilation_status import validate_result
from anneal.operator.context import Context
from anneal.operator.traffic_reader import Prometheus

log = logging.getLogger(__name__)


def _ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def _has_admin_port(pod: dict[str, Any]) -> bool:
    for c in (pod.get("spec") or {}).get("containers") or []:
        for port in c.get("ports") or []:
            if port.get("name") == "admin":
                return True
    return False


class RolloutDriver:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._plans: dict[str, str] = {}  # plan hash -> Plan JSON, for applying and restoring
        self._lock = threading.Lock()

    # -- observe -------------------------------------------------------------------------------

    def pods(self, name: str, ns: str) -> tuple[tuple[rollout.Pod, ...], dict[str, str]]:
        out, ips = [], {}
        for pod in self.ctx.kube.list("v1", "Pod", ns, naming.deployment_selector(name)):
            if pod["metadata"].get("deletionTimestamp"):
                continue
            pname = pod["metadata"]["name"]
            ip = (pod.get("status") or {}).get("podIP")
            ready = _ready(pod)
            served = engine_admin.served_plan_hash(ip) if ready and ip else None
            if ip:
                ips[pname] = ip
            out.append(rollout.Pod(pname, ready, served, _has_admin_port(pod)))
        return tuple(sorted(out, key=lambda p: p.name)), ips

    def proposal(self, ns: str, status: dict[str, Any], spec: api.InferenceDeploymentSpec) -> rollout.Proposal | None:
        ref = status.get("proposedPlan") or {}
        src = str(ref.get("source") or "")
        if not ref.get("hash") or not src.startswith("CompilationJob/"):
            return None
        job = src.split("/", 1)[1]
        drift_job = (status.get("drift") or {}).get("compilationJob")
        if job != drift_job:
            found = self.ctx.kube.get(f"{GROUP}/{VERSION}", cj_api.KIND, job, ns)
            auto = bool(((found or {}).get("spec") or {}).get("autoApply"))
            if not (auto and spec.compilation.mode == "auto"):
                return None
        return rollout.Proposal(ref["hash"], job, ref.get("speedup"), ref.get("configMap"))

    def plan_json(self, name: str, ns: str, plan_hash: str, proposal: rollout.Proposal | None) -> str | None:
        with self._lock:
            if plan_hash in self._plans:
                return self._plans[plan_hash]
        candidates = []
        if proposal and proposal.config_map:
            candidates.append(proposal.config_map)
        candidates += [naming.plan_config_map(name), naming.compiled_plan_config_map(name)]
        for cm in candidates:
            found = self.ctx.kube.config_map(ns, cm)
            if not found or naming.PLAN_KEY not in found[0]:
                continue
            try:
                plan = load_plan(found[0][naming.PLAN_KEY])
            except (ValueError, ValidationError):
                continue
            text = plan.model_dump_json()
            with self._lock:
                self._plans[plan.hash] = text
            if plan.hash == plan_hash:
                return text
        return None

    def token(self, name: str, ns: str) -> str | None:
        secret = self.ctx.kube.get("v1", "Secret", naming.admin_secret(name), ns)
        raw = ((secret or {}).get("data") or {}).get(naming.ADMIN_TOKEN_KEY)
        return base64.b64decode(raw).decode() if raw else None

    def analyze(self, spec: api.InferenceDeploymentSpec, ns: str, st: api.RolloutStatus,
                pods: tuple[rollout.Pod, ...], now: float) -> canary_gates.Analysis | None:
        cp = spec.compilation
        url = cp.prometheus.url or self.ctx.settings.prometheus_url
        if not url:
            return canary_gates.Analysis((canary_gates.GateResult(
                "prometheus", "missing", message="no Prometheus URL configured"),))
        cfg = cp.rollout.canary
        target = canary_gates.GateTarget(
            namespace=ns, canary_pod=st.canary_pod or "",
            stable_pods=tuple(p.name for p in pods if p.ready and p.name != st.canary_pod),
            extra_selector=cp.prometheus.selector,
        )
        since = rollout.parse_iso(st.canary_since)
        window = canary_gates.analysis_window(cfg, duration_seconds(cfg.interval),
                                              None if since is None else now - since)
        with Prometheus(url) as prom:
            return canary_gates.evaluate(lambda q: prom.query_scalar(q, at=now), target, cfg, window)

    # -- execute -------------------------------------------------------------------------------

    def serve(self, name: str, ns: str, actions: list[rollout.ServePlan], pods: tuple[rollout.Pod, ...],
              ips: dict[str, str], proposal: rollout.Proposal | None, logger: Any) -> dict[str, str]:
        errors: dict[str, str] = {}
        if not actions:
            return errors
        token = self.token(name, ns)
        by_name = {p.name: p for p in pods}
        for a in actions:
            pod = by_name.get(a.pod)
            if pod is None or pod.plan_hash == a.plan_hash or a.pod not in ips:
                continue
            text = self.plan_json(name, ns, a.plan_hash, proposal)
            if text is None or token is None:
                errors[a.pod] = f"plan {a.plan_hash} not found" if text is None else "no admin token Secret"
                continue
            try:
                served = engine_admin.apply_plan(ips[a.pod], token, text)
                logger.info("pod %s now serves plan %s", a.pod, served)
            except engine_admin.Unreachable as err:
                logger.warning("pod %s: %s (retrying next tick)", a.pod, err)
            except engine_admin.PlanRefused as err:
                errors[a.pod] = str(err)[:500]
        return errors

    def accept(self, body: kopf.Body, spec: api.InferenceDeploymentSpec, a: rollout.AcceptPlan,
               proposal: rollout.Proposal | None) -> None:
        """The compiled-plan ConfigMap the deployment's plan resolution reads (as autoApply writes
        it), owned by the deployment; idempotent (server-side apply)."""
        name, ns = body.metadata.name, body.metadata.namespace
        kube = self.ctx.kube
        cm_name = proposal.config_map if proposal and proposal.config_map else naming.result_config_map(a.job or "")
        compiled, why = validate_result((kube.config_map(ns, cm_name) or ({}, {}))[0])
        if compiled is None or compiled.plan_hash != a.plan_hash:
            raise kopf.TemporaryError(f"cannot accept plan {a.plan_hash}: {why or 'result changed'}", delay=10)
        base = plan_source.base_plan(spec, lambda cm: kube.config_map(ns, cm))
        cm = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": naming.compiled_plan_config_map(name),
                "namespace": ns,
                "labels": naming.deployment_labels(name),
                "annotations": {
                    naming.ANNOTATION_BASE_PLAN_HASH: base.hash,
                    naming.ANNOTATION_SOURCE: f"CompilationJob/{a.job}",
                    naming.ANNOTATION_PLAN_HASH: compiled.plan_hash,
                },
            },
            "data": {naming.PLAN_KEY: compiled.model_dump_json(indent=2)},
        }
        kopf.adopt(cm, owner=body)
        kube.apply(cm)

    # -- the timer -----------------------------------------------------------------------------

    def tick(self, body: kopf.Body, patch: kopf.Patch, logger: Any, now: float | None = None) -> None:
        name, ns = body.metadata.name, body.metadata.namespace
        status = dict(body.get("status") or {})
        try:
            spec = api.InferenceDeploymentSpec.model_validate(dict(body.spec))
            previous = api.RolloutStatus.model_validate(status["rollout"]) if status.get("rollout") else None
        except ValidationError:
            return
        now = time.time() if now is None else now
        st = previous or api.RolloutStatus()
        proposal = self.proposal(ns, status, spec)
        job = (status.get("drift") or {}).get("compilationJob")
        job_phase, job_message = None, ""
        if job and (st.state in ("Compiling", "Verifying") or job != st.compilation_job):
            found = self.ctx.kube.get(f"{GROUP}/{VERSION}", cj_api.KIND, job, ns)
            job_phase = ((found or {}).get("status") or {}).get("phase") or ("Pending" if found else "Gone")
            job_message = ((found or {}).get("status") or {}).get("message") or ""
        need_pods = st.state in rollout.ACTIVE or (proposal is not None and proposal.plan_hash != status.get("planHash"))
        pods, ips = self.pods(name, ns) if need_pods else ((), {})
        configured = status.get("planHash")
        analysis = None
        if rollout.analysis_due(st, spec.compilation, now):
            analysis = self.analyze(spec, ns, st, pods, now)
        view = rollout.View(now=now, configured_hash=configured, pods=pods, proposal=proposal, job=job,
                            job_phase=job_phase, job_message=job_message, analysis=analysis)
        result = rollout.step(previous, spec.compilation, view)
        events = [a for a in result.actions if isinstance(a, rollout.Event)]
        serves = [a for a in result.actions if isinstance(a, rollout.ServePlan)]
        errors = self.serve(name, ns, serves, pods, ips, proposal, logger)
        if errors:  # the machine decides what a refused plan means, in the same tick
            result2 = rollout.step(result.status, spec.compilation,
                                   rollout.View(**{**view.__dict__, "analysis": None, "apply_errors": errors}))
            events += [a for a in result2.actions if isinstance(a, rollout.Event)]
            self.serve(name, ns, [a for a in result2.actions if isinstance(a, rollout.ServePlan)],
                       pods, ips, proposal, logger)
            result = result2
        for a in result.actions:
            if isinstance(a, rollout.AcceptPlan):
                self.accept(body, spec, a, proposal)
        if previous is None and result.status == api.RolloutStatus() and not result.actions:
            return  # nothing ever rolled out here: no status to write
        new = result.status.wire()
        old = previous.wire() if previous else {}
        if new != old:
            # a merge patch: keys of the last rollout that this one lacks must be nulled explicitly
            patch.status["rollout"] = {**{k: None for k in old if k not in new}, **new}
            if result.status.state == "Succeeded" and status.get("proposedPlan"):
                patch.status["proposedPlan"] = None
        for e in events:
            (kopf.warn if e.warning else kopf.info)(body, reason=e.reason, message=e.message[:1000])
            logger.info("rollout %s: %s", e.reason, e.message)


def register(registry: kopf.OperatorRegistry, ctx: Context) -> RolloutDriver:
    driver = RolloutDriver(ctx)
    kw: dict[str, Any] = dict(group=GROUP, version=VERSION, plural=api.PLURAL, registry=registry)

    @kopf.timer(**kw, interval=ctx.settings.reconcile_interval, initial_delay=ctx.settings.reconcile_interval)
    def advance_plan_rollout(body: kopf.Body, patch: kopf.Patch, logger: Any, **_: Any) -> None:
        """Level-triggered: one step of the canary / promotion / rollback of a compiled plan."""
        driver.tick(body, patch, logger)

    return driver
