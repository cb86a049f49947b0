"""Object builders of the operator: what an InferenceDeployment and a CompilationJob turn into."""

from __future__ import annotations

import dataclasses
import json

import pytest

from anneal.engine.plan import Plan, load_plan
from anneal.operator import compilation_objects as cobj
from anneal.operator import deployment_objects as dobj
from anneal.operator import naming
from anneal.operator.api import CompilationJobSpec, InferenceDeploymentSpec
from anneal.operator.settings import OperatorSettings, from_env

SETTINGS = OperatorSettings(engine_image="registry.local/anneal-engine:test")


def idep(**spec):
    return InferenceDeploymentSpec.model_validate({"model": "random:llama-3.2-1b", **spec})


def cjob(**spec):
    return CompilationJobSpec.model_validate({"target": {"inferenceDeployment": "llama"}, **spec})


def _container(pod_spec):
    (c,) = pod_spec["containers"]
    return c


def test_deployment_runs_anneal_serve_with_the_plan_and_gpus():
    spec = idep(replicas=3, gpus=2, nodeSelector={"gpu": "h200"}, resources={"requests": {"cpu": "8"}})
    d = dobj.deployment("llama", "ml", spec, "abc123", SETTINGS)
    assert d["spec"]["replicas"] == 3
    tpl = d["spec"]["template"]
    assert tpl["metadata"]["annotations"][naming.ANNOTATION_PLAN_HASH] == "abc123"
    assert d["spec"]["selector"]["matchLabels"].items() <= tpl["metadata"]["labels"].items()
    c = _container(tpl["spec"])
    assert c["image"] == "registry.local/anneal-engine:test"
    assert c["command"] == ["anneal"]
    assert c["args"] == [
        "serve", "--model", "random:llama-3.2-1b", "--plan", "/etc/anneal/plan/plan.json",
        "--host", "0.0.0.0", "--port", "8000", "--admin-port", "8001", "--device", "cuda",
    ]
    assert c["resources"] == {"requests": {"cpu": "8", "nvidia.com/gpu": "2"}, "limits": {"nvidia.com/gpu": "2"}}
    assert tpl["spec"]["nodeSelector"] == {"gpu": "h200"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tpl["spec"]["tolerations"]
    # GPU deployments never surge: a plan rollout needs no spare GPUs.
    assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_engine_pod_is_locked_down_and_probed():
    d = dobj.deployment("llama", "ml", idep(), "h", SETTINGS)
    pod = d["spec"]["template"]["spec"]
    c = _container(pod)
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 15 * 60
    token = next(e for e in c["env"] if e["name"] == "ANNEAL_ADMIN_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "llama-admin", "key": "token"}
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp", "/etc/anneal/plan"}
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_cpu_deployment_has_no_gpu_request_and_uses_cpu_device():
    spec = idep(gpus=0, serving={"layers": 2, "extraArgs": ["--max-num-seqs", "8"], "env": [{"name": "X", "value": "1"}]})
    d = dobj.deployment("tiny", "ml", spec, "h", SETTINGS)
    c = _container(d["spec"]["template"]["spec"])
    assert "nvidia.com/gpu" not in json.dumps(d)
    assert c["args"][-6:] == ["--layers", "2", "--device", "cpu", "--max-num-seqs", "8"]
    assert {"name": "X", "value": "1"} in c["env"]


def test_model_volume_is_mounted_read_only():
    spec = idep(model="/models/llama-3.1-8b", modelVolume={"claimName": "weights"})
    pod = dobj.deployment("llama", "ml", spec, "h", SETTINGS)["spec"]["template"]["spec"]
    vol = next(v for v in pod["volumes"] if v["name"] == "model")
    assert vol["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    mount = next(m for m in _container(pod)["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}


def _triton_cache(pod_spec):
    return next(e["value"] for e in _container(pod_spec)["env"] if e["name"] == "TRITON_CACHE_DIR")


def test_kernel_cache_is_mounted_writable_and_triton_compiles_into_it():
    pod = dobj.deployment("llama", "ml", idep(kernelCache={"claimName": "kernels"}), "h", SETTINGS)["spec"]["template"]["spec"]
    vol = next(v for v in pod["volumes"] if v["name"] == "kernel-cache")
    assert vol["persistentVolumeClaim"] == {"claimName": "kernels"}
    mount = next(m for m in _container(pod)["volumeMounts"] if m["name"] == "kernel-cache")
    assert mount == {"name": "kernel-cache", "mountPath": naming.KERNEL_CACHE_MOUNT}
    assert _triton_cache(pod).startswith(naming.KERNEL_CACHE_MOUNT + "/")
    # without one, kernels go to the pod's own emptyDir as before
    plain = dobj.deployment("llama", "ml", idep(), "h", SETTINGS)["spec"]["template"]["spec"]
    assert _triton_cache(plain) == "/tmp/triton"
    assert not any(v["name"] == "kernel-cache" for v in plain["volumes"])


def test_tier_pods_share_the_deployments_kernel_cache_unless_the_job_names_its_own():
    shared = _target(cjob(), idep(kernelCache={"claimName": "kernels"}))
    own = _target(cjob(target={"inferenceDeployment": "llama", "kernelCache": {"claimName": "job-kernels"}}),
                  idep(kernelCache={"claimName": "kernels"}))
    explicit = cobj.resolve_target(CompilationJobSpec.model_validate(
        {"target": {"model": "random:tiny", "kernelCache": {"claimName": "k"}}, "tiers": {"gpus": 0}}), None, SETTINGS)
    for target, claim in ((shared, "kernels"), (own, "job-kernels"), (explicit, "k")):
        for tier in cobj.TIERS:
            pod = cobj.tier_pod("job1", "ml", tier, cjob(), target, SETTINGS)["spec"]
            vol = next(v for v in pod["volumes"] if v["name"] == "kernel-cache")
            assert vol["persistentVolumeClaim"]["claimName"] == claim
            assert _triton_cache(pod).startswith(naming.KERNEL_CACHE_MOUNT)
    assert _target().kernel_cache is None
    # a warm cache on a claim: most candidates hit it, so no compile-ahead (on the H200 it cost 13% there)
    job = cobj.coordinator_job("job1", "ml", cjob(), shared, {"fast": "10.0.0.1", "slow": "10.0.0.2"}, SETTINGS)
    assert "--compile-ahead" not in _container(job["spec"]["template"]["spec"])["args"]


@pytest.mark.parametrize("modes,pods,separate,problem", [
    (["ReadWriteMany"], 5, True, None),
    (["ReadWriteOnce"], 3, False, None),  # the pods may share a node
    (["ReadWriteOnce"], 2, True, "ReadWriteOnce"),  # tiers.spread Required: two nodes
    (["ReadWriteOncePod"], 2, False, "ReadWriteOncePod"),
    (["ReadWriteOncePod"], 1, False, None),
    (["ReadWriteOnce", "ReadWriteMany"], 4, True, None),
])
def test_a_kernel_cache_claim_the_pods_cannot_all_mount_is_named(modes, pods, separate, problem):
    from anneal.operator.api.inference_deployment import KernelCache
    from anneal.operator.engine_pod import kernel_cache_problem

    cache = KernelCache(claimName="k")
    found = kernel_cache_problem({"spec": {"accessModes": modes}}, cache, "spec.kernelCache", "ml", pods, separate)
    assert (found is None) == (problem is None), found
    if problem is not None:
        assert found[0] == "KernelCacheNotShared" and problem in found[1] and "'k' (spec.kernelCache)" in found[1]
    missing = kernel_cache_problem(None, cache, "spec.kernelCache", "ml", pods, separate)
    assert missing == ("KernelCacheNotFound", "PersistentVolumeClaim 'k' (spec.kernelCache) does not exist in ml")


def test_service_exposes_only_the_public_port():
    svc = dobj.service("llama", "ml")
    assert [p["port"] for p in svc["spec"]["ports"]] == [8000]
    assert svc["spec"]["selector"] == naming.deployment_selector("llama")
    assert dobj.endpoint("llama", "ml") == "http://llama.ml.svc:8000/v1"


def test_plan_config_map_round_trips_to_the_same_hash():
    plan = Plan.model_validate({"scheduler": {"max_num_seqs": 32}})
    cm = dobj.plan_config_map("llama", "ml", plan, "spec.plan")
    assert load_plan(cm["data"]["plan.json"]).hash == plan.hash
    assert cm["metadata"]["annotations"][naming.ANNOTATION_PLAN_HASH] == plan.hash


def test_admin_tokens_are_random():
    a = dobj.admin_secret("x-admin", "ml", {})["stringData"]["token"]
    b = dobj.admin_secret("x-admin", "ml", {})["stringData"]["token"]
    assert a != b and len(a) >= 32


def _target(spec=None, deployment=None):
    return cobj.resolve_target(spec or cjob(), deployment if deployment is not None else idep(gpus=2, image="eng:1"), SETTINGS)


def test_target_takes_the_deployments_hardware():
    spec = cjob(tiers={"gpus": 7, "nodeSelector": {"pool": "compile"}})
    t = _target(spec, idep(gpus=2, nodeSelector={"gpu": "h200"}, image="eng:1"))
    assert t.placement.gpus == 2 and t.image == "eng:1"
    assert t.placement.node_selector == {"gpu": "h200", "pool": "compile"}
    explicit = cobj.resolve_target(
        CompilationJobSpec.model_validate({"target": {"model": "random:tiny"}, "tiers": {"gpus": 0}}), None, SETTINGS
    )
    assert explicit.placement.gpus == 0 and explicit.image == SETTINGS.engine_image and explicit.model == "random:tiny"


@pytest.mark.parametrize("spread,key", [("Required", "requiredDuringSchedulingIgnoredDuringExecution"),
                                        ("Preferred", "preferredDuringSchedulingIgnoredDuringExecution")])
def test_tier_pods_fast_loads_k_layers_and_they_repel_each_other(spread, key):
    spec = cjob(tiers={"fastLayers": 3, "spread": spread})
    target = _target(spec)
    fast = cobj.tier_pod("job1", "ml", "fast", spec, target, SETTINGS)
    slow = cobj.tier_pod("job1", "ml", "slow", spec, target, SETTINGS)
    assert fast["metadata"]["name"] == "job1-fast" and slow["metadata"]["name"] == "job1-slow"
    fa, sa = _container(fast["spec"])["args"], _container(slow["spec"])["args"]
    assert fa[fa.index("--layers") + 1] == "3" and "--layers" not in sa
    assert fa[fa.index("--host") + 1] == "$(POD_IP)"
    assert fast["spec"]["restartPolicy"] == "Never"
    anti = fast["spec"]["affinity"]["podAntiAffinity"][key]
    assert json.dumps(anti).count('"anneal.dev/compilation-job": "job1"') == 1
    assert fast["metadata"]["labels"][naming.LABEL_TIER] == "fast"
    assert _container(fast["spec"])["resources"]["limits"]["nvidia.com/gpu"] == "2"


def test_tier_pods_of_a_split_deployment_start_at_its_degree():
    """The tiers run the degree of the plan the deployment's replicas serve (resolved by the handler
    into ``Target.tensor_parallel``): the search then measures, and its winner keeps, a degree the
    deployment can apply. Degree 1 adds no flag."""
    spec = cjob()
    split = dataclasses.replace(_target(spec), tensor_parallel=2)
    for tier in ("fast", "slow"):
        args = _container(cobj.tier_pod("job1", "ml", tier, spec, split, SETTINGS)["spec"])["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == "2"
        assert "--tensor-parallel-size" not in _container(cobj.tier_pod("job1", "ml", tier, spec, _target(spec), SETTINGS)["spec"])["args"]


def test_coordinator_job_runs_anneal_compile_against_both_engines():
    spec = cjob(budget="30m", retries=3, agents=["plan-search", "llm-writer"],
                llm={"credentials": {"name": "anthropic", "key": "k"}, "provider": "anthropic"})
    job = cobj.coordinator_job("job1", "ml", spec, _target(spec), {"fast": "10.0.0.1", "slow": "10.0.0.2"}, SETTINGS)
    assert job["spec"]["backoffLimit"] == 3
    fail, ignore = job["spec"]["podFailurePolicy"]["rules"]  # a lost engine is the operator's restart, not the Job's
    assert fail["action"] == "FailJob" and fail["onExitCodes"]["values"] == [2, 3]
    assert ignore == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert job["spec"]["activeDeadlineSeconds"] == 1800 + cobj.COORDINATOR_MARGIN_S
    pod = job["spec"]["template"]["spec"]
    c = _container(pod)
    assert c["args"] == [
        "compile", "--model", "random:llama-3.2-1b", "--traffic", "chat", "--budget", "1800",
        "--out", "/work/out", "--engines", "http://10.0.0.1:8001,http://10.0.0.2:8001", "--report-to", "ml/job1",
        "--compile-ahead",  # the tiers' Triton cache starts empty: no spec.kernelCache
    ]
    assert pod["serviceAccountName"] == "job1-coordinator"
    env = {e["name"]: e for e in c["env"]}
    assert env["ANTHROPIC_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "anthropic", "key": "k"}
    assert env["ANNEAL_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "job1-admin"
    opts = json.loads(env["ANNEAL_COMPILE_OPTIONS"]["value"])
    assert opts["agents"] == ["plan-search", "llm-writer"] and opts["resultConfigMap"] == "job1-result"
    assert opts["verification"]["tolerances"]["logits_rtol"] == 0.02
    assert c["resources"]["requests"] == {"cpu": "1", "memory": "2Gi"}
    assert "nvidia.com/gpu" not in json.dumps(job)


def test_fp8_weights_reach_the_compile_only_when_the_job_asks():
    """Weight-only fp8 is lossy: a CompilationJob opts in (spec.fp8Weights) and `anneal compile`
    reads it from ANNEAL_COMPILE_OPTIONS like its --fp8-weights flag."""
    assert cobj.compile_options("j", cjob())["fp8Weights"] is False
    assert cobj.compile_options("j", cjob(fp8Weights=True))["fp8Weights"] is True


def test_traffic_shape_reaches_the_coordinator_as_a_file():
    spec = cjob(traffic={"shape": {"prompt_len": {"mean": 900}}})
    cm = cobj.traffic_config_map("job1", "ml", spec)
    assert json.loads(cm["data"]["traffic.json"]) == {"prompt_len": {"mean": 900}}
    job = cobj.coordinator_job("job1", "ml", spec, _target(spec), {"fast": "a", "slow": "b"}, SETTINGS)
    args = _container(job["spec"]["template"]["spec"])["args"]
    assert args[args.index("--traffic") + 1] == "/etc/anneal/traffic/traffic.json"
    assert cobj.traffic_config_map("job1", "ml", cjob()) is None


def test_seed_plans_reach_the_coordinator_as_files():
    seeds = (Plan.model_validate({"scheduler": {"max_num_seqs": 8}}).model_dump_json(), Plan().model_dump_json())
    target = dataclasses.replace(_target(), seed_plans=seeds)
    cm = cobj.seeds_config_map("job1", "ml", target)
    assert cm["metadata"]["name"] == "job1-seeds"
    assert [load_plan(cm["data"][k]).scheduler.max_num_seqs for k in ("seed-0.json", "seed-1.json")] == [8, Plan().scheduler.max_num_seqs]
    pod = cobj.coordinator_job("job1", "ml", cjob(), target, {"fast": "a", "slow": "b"}, SETTINGS)["spec"]["template"]["spec"]
    args = _container(pod)["args"]
    assert args[args.index("--seed-plans") + 1] == "/etc/anneal/seeds/seed-0.json,/etc/anneal/seeds/seed-1.json"
    (mount,) = [m for m in _container(pod)["volumeMounts"] if m["name"] == "seeds"]
    assert mount == {"name": "seeds", "mountPath": "/etc/anneal/seeds", "readOnly": True}
    assert {"name": "seeds", "configMap": {"name": "job1-seeds"}} in pod["volumes"]
    # no seeds: no ConfigMap, no flag
    assert cobj.seeds_config_map("job1", "ml", _target()) is None
    plain = cobj.coordinator_job("job1", "ml", cjob(), _target(), {"fast": "a", "slow": "b"}, SETTINGS)
    assert "--seed-plans" not in _container(plain["spec"]["template"]["spec"])["args"]


def test_seed_plans_are_plan_sources_and_at_most_eight():
    assert cjob(seedPlans=[{"inline": {"scheduler": {"max_num_seqs": 8}}}]).seed_plans[0].inline
    with pytest.raises(ValueError, match="exactly one"):
        cjob(seedPlans=[{}])
    with pytest.raises(ValueError, match="at most 8"):
        cjob(seedPlans=[{"configMapRef": {"name": f"p{i}"}} for i in range(9)])


def test_coordinator_role_is_namespaced_and_names_only_its_objects():
    role = cobj.role("job1", "ml")
    assert role["kind"] == "Role" and role["metadata"]["namespace"] == "ml"
    for rule in role["rules"]:
        assert rule["resourceNames"], rule
        assert set(rule["verbs"]) <= {"get", "patch"}
    grants = {(r["resources"][0], v) for r in role["rules"] for v in r["verbs"]}
    assert ("compilationjobs/status", "patch") in grants and ("configmaps", "patch") in grants
    assert ("compilationjobs", "patch") not in grants  # cannot change its own spec
    binding = cobj.role_binding("job1", "ml")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "job1-coordinator", "namespace": "ml"}]


def test_settings_from_env_and_clear_errors():
    s = from_env({"ANNEAL_WATCH_NAMESPACES": "a, b", "ANNEAL_LOG_LEVEL": "debug", "ANNEAL_STANDALONE": "true"})
    assert s.watch_namespaces == ["a", "b"] and s.log_level == "DEBUG" and s.standalone
    with pytest.raises(SystemExit, match="ANNEAL_PROMETHEUS_URL"):
        from_env({"ANNEAL_PROMETHEUS_URL": "prometheus:9090"})
