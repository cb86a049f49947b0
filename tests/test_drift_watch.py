"""The drift watch's pure parts: the CRD policy as the drift decision's policy, the selector of a
deployment's pods, and the CompilationJob it creates (valid under our own models)."""

from __future__ import annotations

import pytest

from anneal.engine.plan import Plan, default_plan
from anneal.engine.traffic import preset
from anneal.operator import drift
from anneal.operator.api.compilation_job import CompilationJobSpec
from anneal.operator.api.inference_deployment import InferenceDeploymentSpec
from anneal.operator.drift_watch import compilation_job, job_name, pod_selector, policy_for


def spec(**compilation) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({"model": "random:tiny", "gpus": 0, "compilation": compilation})


def test_crd_policy_maps_onto_the_drift_decision():
    p = policy_for(spec(
        drift={"threshold": 2.0, "consecutiveWindows": 4, "minRequests": 50, "cooldown": "1h",
               "checkInterval": "1m", "maxStaleness": "10m", "weights": {"promptLength": 2.0, "prefixReuse": 0}},
        prometheus={"window": "5m"},
    ))
    assert (p.enter_threshold, p.exit_threshold, p.consecutive_windows) == (2.0, pytest.approx(1.4), 4)
    assert (p.min_requests, p.min_window_seconds, p.cooldown_seconds, p.max_staleness_seconds) == (50, 300, 3600, 600)
    assert p.scales.prompt_len_log2 == 0.5  # weight 2: half a doubling scores 1.0
    assert p.scales.output_len_log2 == 1.0
    assert p.scales.prefix_hit > 1e9  # weight 0: the part can never set the score


def test_weights_and_hysteresis_are_validated():
    with pytest.raises(ValueError, match="unknown drift part"):
        spec(drift={"weights": {"latency": 1.0}})
    with pytest.raises(ValueError, match="exitThreshold"):
        spec(drift={"threshold": 1.0, "exitThreshold": 2.0})


def test_a_weighted_part_changes_the_decision():
    chat, rag = preset("chat"), preset("rag")
    plain = drift.drift_score(chat, rag, policy_for(spec()).scales)
    muted = drift.drift_score(chat, rag, policy_for(spec(drift={"weights": {"promptLength": 0.0}})).scales)
    assert plain.dominant == "prompt_len_log2" and muted.dominant != "prompt_len_log2"
    assert muted.score < plain.score


def test_staleness_never_shorter_than_two_checks():
    p = policy_for(spec(drift={"checkInterval": "30m", "maxStaleness": "5m"}))
    assert p.max_staleness_seconds == 3600


def test_pod_selector_and_job_names():
    assert pod_selector("llama", "ml") == 'namespace="ml",pod=~"llama-[a-z0-9]+-[a-z0-9]+"'
    assert pod_selector("llama", "ml", '{cluster="eu"}').endswith(',cluster="eu"')
    name = job_name("a" * 48, 1_800_000_000)
    assert len(name) <= 40 and name.startswith("a" * 26 + "-drift-")
    assert job_name("x", 1_800_000_000) != job_name("x", 1_800_000_001)


def test_the_compilation_job_targets_the_deployment_with_the_observed_shape():
    s = spec(search={"budget": "2m", "fastLayers": 1, "agents": ["plan-search"]})
    shape = preset("agentic")
    job = compilation_job("llama", "ml", s, shape, "llama-drift-1")
    body = CompilationJobSpec.model_validate(job["spec"])
    assert body.target.inference_deployment == "llama" and body.auto_apply is False
    assert body.traffic.shape["name"] == shape.name and body.budget == "2m" and body.agents == ["plan-search"]
    assert job["metadata"]["labels"]["anneal.dev/trigger"] == "drift"
    # the policy's preset wins over the observed shape
    job = compilation_job("llama", "ml", spec(traffic="rag"), shape, "llama-drift-2")
    assert job["spec"]["traffic"] == {"preset": "rag"}


def test_the_compilation_job_is_seeded_with_the_serving_plan():
    s = spec(search={"budget": "2m"})
    serving = Plan.model_validate({"scheduler": {"max_num_seqs": 24}})
    body = CompilationJobSpec.model_validate(compilation_job("llama", "ml", s, preset("chat"), "j", serving)["spec"])
    (seed,) = body.seed_plans
    assert Plan.model_validate(seed.inline).hash == serving.hash
    # the device's default plan is where the job's engines start anyway: no seed
    for plan in (Plan(), None):
        assert "seedPlans" not in compilation_job("llama", "ml", s, preset("chat"), "j", plan)["spec"]
    on_gpus = InferenceDeploymentSpec.model_validate({"model": "random:tiny", "gpus": 1, "compilation": {}})
    assert "seedPlans" not in compilation_job("llama", "ml", on_gpus, preset("chat"), "j", default_plan("cuda"))["spec"]
    # ... but a GPU deployment pinned to the reference plan is seeded with it (its engines start elsewhere)
    assert "seedPlans" in compilation_job("llama", "ml", on_gpus, preset("chat"), "j", Plan())["spec"]


def test_never_two_compilations_and_manual_overrides_block_a_trigger():
    from anneal.operator.drift_watch import blocker

    cp = spec().compilation

    def job(name, target, phase=None, deleting=False):
        meta = {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
        return {"metadata": meta, "spec": {"target": {"inferenceDeployment": target}},
                "status": {"phase": phase} if phase else {}}

    assert blocker("llama", cp, {}, []) is None
    assert blocker("llama", cp, {}, [job("j1", "llama")]) == "CompilationJob j1 is Pending"
    assert blocker("llama", cp, {}, [job("j1", "llama", "Searching")]) == "CompilationJob j1 is Searching"
    assert blocker("llama", cp, {}, [job("j1", "llama", "Succeeded"), job("j2", "other", "Searching"),
                                    job("j3", "llama", "Verifying", deleting=True)]) is None
    assert blocker("llama", cp, {"rollout": {"state": "Canary"}}, []) == "a rollout is in progress (Canary)"
    assert blocker("llama", spec(paused=True).compilation, {}, []) == "paused"
    assert blocker("llama", spec(pinnedPlan={"inline": {}}).compilation, {}, []) == "pinnedPlan is set"
