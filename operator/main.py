"""`anneal operator`: runs the kopf operator with both resources' handlers.

Leader election is kopf peering: every replica joins the peering object named by
ANNEAL_PEERING_NAME (the chart creates it); only the highest-priority one handles resources.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

import kopf

from anneal.operator import compilation_handlers, deployment_handlers, drift_watch, rollout_handlers
from anneal.operator.context import Context
from anneal.operator.settings import OperatorSettings, from_env


def build_registry(ctx: Context) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    deployment_handlers.register(registry, ctx)
    compilation_handlers.register(registry, ctx)
    drift_watch.register(registry, ctx)  # issue 8: drift -> CompilationJob
    rollout_handlers.register(registry, ctx)  # issue 8: canary, promote, roll back

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> Any:
        """In-cluster service account, else the kubeconfig (a private registry has no default login)."""
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        """Keep kopf's bookkeeping in annotations (our status schema is ours), post events at info."""
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="anneal.dev")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="anneal.dev", key="last-handled-configuration"
        )
        settings.persistence.finalizer = "anneal.dev/finalizer"
        settings.posting.level = logging.INFO
        settings.peering.priority = ctx.settings.priority
        settings.execution.max_workers = 8

    return registry


def run(settings: OperatorSettings, verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else getattr(logging, settings.log_level))
    ctx = Context(settings)
    registry = build_registry(ctx)
    liveness = f"http://{settings.liveness_host}:{settings.liveness_port}/healthz" if settings.liveness_port else None
    asyncio.run(
        kopf.operator(
            registry=registry,
            clusterwide=not settings.watch_namespaces,
            namespaces=settings.watch_namespaces,
            standalone=settings.standalone,
            peering_name=None if settings.standalone else settings.peering_name,
            priority=settings.priority,
            liveness_endpoint=liveness,
        )
    )


def add_operator_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `anneal operator` (settings otherwise come from ANNEAL_* env vars, see settings.py)."""
    parser.add_argument("--namespace", "-n", action="append", default=None, help="watch only these namespaces")
    parser.add_argument("--standalone", action="store_true", help="no peering (single replica, development)")
    parser.add_argument("--liveness-port", type=int, default=None, help="0 disables the /healthz endpoint")
    parser.add_argument("--verbose", "-v", action="store_true")


def run_operator(args: argparse.Namespace) -> int:
    """`anneal operator`."""
    settings = from_env()
    updates: dict[str, Any] = {}
    if args.namespace:
        updates["watch_namespaces"] = args.namespace
    if args.standalone:
        updates["standalone"] = True
    if args.liveness_port is not None:
        updates["liveness_port"] = args.liveness_port
    run(settings.model_copy(update=updates), verbose=args.verbose)
    return 0


def run_crds(_args: argparse.Namespace | None = None) -> int:
    """`anneal crds`: the CRD YAML on stdout."""
    from anneal.operator.crdgen import print_crds

    print_crds()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="anneal operator", description="Run the Anneal Kubernetes operator.")
    add_operator_args(parser)
    return run_operator(parser.parse_args(argv))
