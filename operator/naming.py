"""Names and labels of the objects the operator owns, derived deterministically from the owner's
name, so a restarted operator finds its children instead of creating duplicates."""

from __future__ import annotations

MANAGED_BY = "anneal-operator"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_DEPLOYMENT = "anneal.dev/inference-deployment"
LABEL_JOB = "anneal.dev/compilation-job"
LABEL_TIER = "anneal.dev/tier"
ANNOTATION_PLAN_HASH = "anneal.dev/plan-hash"
ANNOTATION_BASE_PLAN_HASH = "anneal.dev/base-plan-hash"
ANNOTATION_SOURCE = "anneal.dev/source"

ADMIN_TOKEN_KEY = "token"
PLAN_KEY = "plan.json"
LEDGER_KEY = "ledger.sqlite.gz"  # binaryData of <job>-ledger: the coordinator's ledger, gzipped
# The coordinator's exit status when an engine it was given died or stopped answering: not the
# search's failure but a restart's cue (engines and coordinator; the new one resumes the ledger).
EXIT_ENGINES_LOST = 3
TRAFFIC_KEY = "traffic.json"
PLAN_MOUNT = "/etc/anneal/plan"
KERNEL_CACHE_MOUNT = "/var/cache/anneal"  # spec.kernelCache; Triton's cache is its triton/ folder
TRAFFIC_MOUNT = "/etc/anneal/traffic"
SEEDS_MOUNT = "/etc/anneal/seeds"
PUBLIC_PORT = 8000
ADMIN_PORT = 8001


# InferenceDeployment children.
def deployment(name: str) -> str:
    return name


def service(name: str) -> str:
    return name


def plan_config_map(name: str) -> str:
    return f"{name}-plan"


def compiled_plan_config_map(name: str) -> str:
    """The compiled plan a deployment accepted (written when a CompilationJob applies)."""
    return f"{name}-compiled"


def admin_secret(name: str) -> str:
    return f"{name}-admin"


def deployment_labels(name: str) -> dict[str, str]:
    return {
        LABEL_NAME: "anneal-engine",
        LABEL_INSTANCE: name,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_DEPLOYMENT: name,
    }


def deployment_selector(name: str) -> dict[str, str]:
    return {LABEL_NAME: "anneal-engine", LABEL_DEPLOYMENT: name}


# CompilationJob children.
def tier_pod(job: str, tier: str) -> str:
    return f"{job}-{tier}"


def coordinator(job: str) -> str:
    return f"{job}-coordinator"


def result_config_map(job: str) -> str:
    return f"{job}-result"


def ledger_config_map(job: str) -> str:
    return f"{job}-ledger"


def traffic_config_map(job: str) -> str:
    return f"{job}-traffic"


def seeds_config_map(job: str) -> str:
    return f"{job}-seeds"


def seed_key(index: int) -> str:
    return f"seed-{index}.json"


def job_secret(job: str) -> str:
    return f"{job}-admin"


def job_labels(job: str, component: str) -> dict[str, str]:
    return {
        LABEL_NAME: "anneal-compilation",
        LABEL_INSTANCE: job,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_COMPONENT: component,
        LABEL_JOB: job,
    }
