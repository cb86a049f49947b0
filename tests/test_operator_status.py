"""InferenceDeployment status computation, plan resolution, pod diagnosis and conditions."""

from __future__ import annotations

import pytest

from anneal.engine.plan import CompiledPlan, Gain, Parallelism, Plan, default_plan
from anneal.operator import conditions as cond
from anneal.operator import naming, pod_health
from anneal.operator.api import InferenceDeploymentSpec
from anneal.operator.deployment_status import Observed, changed, compute
from anneal.operator.plan_source import PlanError, ResolvedPlan, base_plan, resolve

PLAN = Plan.model_validate({"scheduler": {"max_num_seqs": 16}})


def spec(**kw):
    return InferenceDeploymentSpec.model_validate({"model": "random:tiny", "replicas": 2, **kw})


def deployment(hash_=PLAN.hash, replicas=2, ready=2, updated=2, generation=3, observed=3):
    return {
        "metadata": {"generation": generation},
        "spec": {"template": {"metadata": {"annotations": {naming.ANNOTATION_PLAN_HASH: hash_}}}},
        "status": {"observedGeneration": observed, "replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated},
    }


def pod(name="p", phase="Running", ready=True, waiting=None, terminated=None, unschedulable=None):
    conds = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable:
        conds.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable})
    cs = {"state": {"waiting": waiting} if waiting else {"running": {}}}
    if terminated:
        cs["lastState"] = {"terminated": terminated}
    return {"metadata": {"name": name}, "status": {"phase": phase, "conditions": conds, "containerStatuses": [cs]}}


def ready_obs(**kw):
    return Observed(deployment=deployment(), pods=[pod("a"), pod("b")], plan=ResolvedPlan(PLAN, "spec.plan"), gpu_capacity=8, **kw)


def test_ready_when_all_replicas_serve_the_plan():
    st = compute("llama", "ml", spec(), 3, ready_obs(), None)
    assert st["phase"] == "Ready"
    assert st["planHash"] == st["servingPlanHash"] == PLAN.hash
    assert st["readyReplicas"] == 2 and st["endpoint"] == "http://llama.ml.svc:8000/v1"
    ready = cond.find(st["conditions"], "Ready")
    assert ready["status"] == "True" and ready["observedGeneration"] == 3
    assert {c["type"] for c in st["conditions"]} == {
        "PlanResolved", "ResourcesReady", "Schedulable", "Available", "PlanServing", "Ready"}


def test_status_is_written_only_when_something_changed():
    first = compute("llama", "ml", spec(), 3, ready_obs(), None)
    again = compute("llama", "ml", spec(), 3, ready_obs(), first)
    assert changed(first, again) == {}
    fewer = compute("llama", "ml", spec(), 3, Observed(deployment=deployment(ready=1), pods=[pod("a"), pod("b", ready=False)],
                                                       plan=ResolvedPlan(PLAN, "spec.plan")), first)
    diff = changed(first, fewer)
    assert diff["readyReplicas"] == 1 and diff["phase"] == "Progressing"
    # the transition time of a condition that did not flip stays put
    keep = {c["type"]: c for c in diff["conditions"]}
    old = {c["type"]: c for c in first["conditions"]}
    assert keep["PlanResolved"]["lastTransitionTime"] == old["PlanResolved"]["lastTransitionTime"]


def test_pending_before_the_deployment_exists():
    st = compute("llama", "ml", spec(), 1, Observed(plan=ResolvedPlan(PLAN, "default"), applied=False), None)
    assert st["phase"] == "Pending" and cond.find(st["conditions"], "Ready")["status"] == "False"


def test_new_plan_rolling_out_is_progressing_and_keeps_the_old_serving_hash():
    previous = compute("llama", "ml", spec(), 3, ready_obs(), None)
    new_plan = Plan.model_validate({"scheduler": {"max_num_seqs": 8}})
    obs = Observed(deployment=deployment(hash_=new_plan.hash, updated=1, generation=4, observed=4),
                   pods=[pod("a"), pod("b")], plan=ResolvedPlan(new_plan, "CompilationJob/x"))
    st = compute("llama", "ml", spec(), 4, obs, previous)
    assert st["phase"] == "Progressing"
    assert st["planHash"] == new_plan.hash and st["servingPlanHash"] == PLAN.hash
    assert cond.find(st["conditions"], "PlanServing")["reason"] == "RolloutInProgress"


def test_crash_loop_fails_with_the_engines_last_words():
    crashing = pod("a", ready=False, waiting={"reason": "CrashLoopBackOff", "message": "back-off"},
                   terminated={"exitCode": 1, "message": "FileNotFoundError: /models/nope has no config.json"})
    obs = Observed(deployment=deployment(ready=0), pods=[crashing], plan=ResolvedPlan(PLAN, "spec.plan"))
    st = compute("llama", "ml", spec(), 3, obs, None)
    assert st["phase"] == "Failed"
    avail = cond.find(st["conditions"], "Available")
    assert avail["reason"] == "EngineCrashing" and "/models/nope" in avail["message"]
    # with one healthy replica left it is Degraded, not Failed
    obs.deployment = deployment(ready=1)
    obs.pods = [pod("b"), crashing]
    assert compute("llama", "ml", spec(), 3, obs, None)["phase"] == "Degraded"


def test_more_gpus_than_any_node_offers():
    obs = ready_obs()
    obs.gpu_capacity = 4
    st = compute("llama", "ml", spec(gpus=8), 3, obs, None)
    sched = cond.find(st["conditions"], "Schedulable")
    assert sched["status"] == "False" and sched["reason"] == "InsufficientGPUs" and "offers 4" in sched["message"]
    assert st["phase"] == "Degraded"


def test_gpus_the_plan_does_not_use_are_named_without_blocking_ready():
    """A replica runs its plan's tensor-parallel degree of GPUs: asking for two with a degree-1 plan
    holds one idle. Said in Schedulable (still True: the pods run), so `kubectl describe` shows it;
    the phase stays Ready. A plan of a higher degree than the GPUs could not start: not schedulable."""
    st = compute("llama", "ml", spec(gpus=2), 3, ready_obs(), None)
    sched = cond.find(st["conditions"], "Schedulable")
    assert sched["status"] == "True" and sched["reason"] == "ExtraGPUsIdle"
    assert "requests 2 nvidia.com/gpu" in sched["message"] and "1 idle per replica" in sched["message"]
    assert st["phase"] == "Ready"
    assert cond.find(compute("llama", "ml", spec(gpus=1), 3, ready_obs(), None)["conditions"],
                     "Schedulable")["reason"] == "Schedulable"
    tp2 = PLAN.model_copy(update={"parallelism": Parallelism(tensor_parallel=2)})
    for gpus, status, reason in ((2, "True", "Schedulable"), (1, "False", "TooFewGPUsForPlan"),
                                 (4, "True", "ExtraGPUsIdle")):
        obs = ready_obs()
        obs.plan = ResolvedPlan(tp2, "spec.plan")
        got = cond.find(compute("llama", "ml", spec(gpus=gpus), 3, obs, None)["conditions"], "Schedulable")
        assert (got["status"], got["reason"]) == (status, reason), (gpus, got)


def test_unschedulable_pod_is_reported():
    obs = Observed(deployment=deployment(ready=0), pods=[pod("a", phase="Pending", ready=False, unschedulable="0/3 nodes are available")],
                   plan=ResolvedPlan(PLAN, "default"))
    st = compute("llama", "ml", spec(), 3, obs, None)
    assert cond.find(st["conditions"], "Schedulable")["message"].endswith("0/3 nodes are available")


def test_unresolvable_plan_keeps_reporting_the_configured_one():
    previous = compute("llama", "ml", spec(), 3, ready_obs(), None)
    obs = ready_obs()
    obs.plan, obs.plan_error = None, PlanError("PlanConfigMapNotFound", "spec.plan: ConfigMap 'p' does not exist")
    st = compute("llama", "ml", spec(), 4, obs, previous)
    assert st["planHash"] == PLAN.hash and st["phase"] == "Degraded"
    assert cond.find(st["conditions"], "PlanResolved")["reason"] == "PlanConfigMapNotFound"


def test_missing_model_volume():
    obs = ready_obs(missing=[("ModelVolumeNotFound", "PersistentVolumeClaim 'w' does not exist")])
    st = compute("llama", "ml", spec(), 3, obs, None)
    assert cond.find(st["conditions"], "ResourcesReady")["reason"] == "ModelVolumeNotFound"


# --- plan resolution ----------------------------------------------------------------------------

def _store(**maps):
    return lambda name: maps.get(name.replace("-", "_"))


def _compiled(plan, gain=1.4):
    return CompiledPlan(plan=plan, model="random:tiny", hardware="H200",
                        gains=[Gain(metric="tokens/s", baseline=100, candidate=100 * gain)],
                        verification={"passed": True}).model_dump_json()


def test_resolution_order():
    s = spec(plan={"configMapRef": {"name": "base"}})
    compiled = Plan.model_validate({"scheduler": {"max_num_seqs": 4}})
    base_hash = PLAN.hash
    store = _store(base=({"plan.json": PLAN.model_dump_json()}, {}),
                   llama_compiled=({"plan.json": _compiled(compiled)},
                                   {naming.ANNOTATION_BASE_PLAN_HASH: base_hash, naming.ANNOTATION_SOURCE: "CompilationJob/j"}))
    got = resolve("llama", s, store)
    assert got.hash == compiled.hash and got.source == "CompilationJob/j" and got.speedup == 1.4
    # a different base plan makes the compiled one stale
    s2 = spec(plan={"inline": {"scheduler": {"max_num_seqs": 2}}})
    assert resolve("llama", s2, store).source == "spec.plan"
    # the pinned plan wins over everything
    s3 = spec(plan={"configMapRef": {"name": "base"}}, compilation={"pinnedPlan": {"inline": {}}})
    assert resolve("llama", s3, store) == ResolvedPlan(Plan(), "pinnedPlan")
    # no spec.plan: the default plan of the pods' device (GPUs: CUDA, unless serving.device says otherwise)
    assert base_plan(spec(), store) == ResolvedPlan(default_plan("cuda"), "default")
    assert base_plan(spec(gpus=0), store).hash == Plan().hash
    assert base_plan(spec(serving={"device": "cpu"}), store).hash == Plan().hash
    assert default_plan("cuda").hash != Plan().hash


@pytest.mark.parametrize("store,reason", [
    ({}, "PlanConfigMapNotFound"),
    ({"base": ({"other": "{}"}, {})}, "PlanKeyNotFound"),
    ({"base": ({"plan.json": '{"ops": {"nonsense": {}}}'}, {})}, "InvalidPlan"),
])
def test_plan_errors_have_reasons(store, reason):
    with pytest.raises(PlanError) as err:
        resolve("llama", spec(plan={"configMapRef": {"name": "base"}}), _store(**store))
    assert err.value.reason == reason


# --- pods and conditions ------------------------------------------------------------------------

def test_pod_problems():
    assert pod_health.problem(pod()) is None
    assert pod_health.problem(pod(ready=False, waiting={"reason": "ImagePullBackOff", "message": "not found"})).reason == "ImagePullFailed"
    cfg = pod_health.problem(pod(ready=False, waiting={"reason": "CreateContainerConfigError", "message": 'secret "x" not found'}))
    assert cfg.reason == "ContainerConfigError" and cfg.fatal and 'secret "x"' in cfg.message
    assert pod_health.is_ready(pod()) and not pod_health.is_ready(pod(ready=False))


def test_max_allocatable_respects_selector_and_cordons():
    nodes = [
        {"metadata": {"labels": {"gpu": "h200"}}, "status": {"allocatable": {"nvidia.com/gpu": "8"}}},
        {"metadata": {"labels": {"gpu": "a10"}}, "status": {"allocatable": {"nvidia.com/gpu": "16"}}},
        {"metadata": {"labels": {"gpu": "h200"}}, "spec": {"unschedulable": True}, "status": {"allocatable": {"nvidia.com/gpu": "32"}}},
    ]
    assert pod_health.max_allocatable(nodes, "nvidia.com/gpu", {"gpu": "h200"}) == 8
    assert pod_health.max_allocatable(nodes, "nvidia.com/gpu", {}) == 16
    assert pod_health.max_allocatable(nodes, "amd.com/gpu", {}) == 0


def test_ready_aggregates_the_first_failing_condition():
    obs = [cond.Observation("A", True, "Ok"), cond.Observation("B", False, "Broken", "fix it"), cond.Observation("C", None, "Unknown")]
    ready = cond.aggregate(obs)
    assert ready.status == "False" and ready.reason == "Broken" and ready.message == "B: fix it"
    assert cond.aggregate([cond.Observation("A", True, "Ok")]).status == "True"


def test_a_spec_only_the_models_refuse_becomes_a_condition():
    from pydantic import ValidationError

    from anneal.operator.deployment_handlers import invalid_spec_status

    previous = compute("llama", "ml", spec(), 3, ready_obs(), None)
    try:
        InferenceDeploymentSpec.model_validate({"model": "random:tiny", "replicas": "many"})
    except ValidationError as exc:
        st = invalid_spec_status(previous, exc, 4)
    assert st["phase"] == "Failed" and "replicas" in st["message"]
    ready = cond.find(st["conditions"], "Ready")
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec" and ready["observedGeneration"] == 4
    assert cond.find(st["conditions"], "PlanResolved") == cond.find(previous["conditions"], "PlanResolved")


def test_inline_plans_are_checked_when_resolved_not_when_parsed():
    s = spec(plan={"inline": {"ops": {"no_such_op": {}}}})  # the spec itself is fine
    with pytest.raises(Exception) as err:
        resolve("llama", s, _store())
    assert "no_such_op" in str(err.value)


def test_a_new_reason_is_a_transition_but_keeps_the_transition_time():
    first = cond.merge([], [cond.Observation("Available", False, "ReplicasNotReady")], 1, now="t1")
    second = cond.merge(first, [cond.Observation("Available", False, "EngineCrashing", "exit 2")], 1, now="t2")
    changed_ = cond.transitions(first, second)
    assert [c["type"] for c in changed_] == ["Available", "Ready"]  # Ready names the new reason too
    assert cond.find(second, "Available")["lastTransitionTime"] == "t1"  # status did not flip
    assert cond.transitions(second, second) == []
