"""`up` and `down` for humans: one cluster per state directory (default $ANNEAL_CACHE/e2e-cluster)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import procs
from .cluster import LocalCluster

DEFAULT_STATE = Path(os.environ.get("ANNEAL_CACHE", Path.home() / ".cache" / "anneal")) / "e2e-cluster"


def up(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="e2e/cluster/up", description="Start the local control plane "
                                 "(etcd, kube-apiserver, controller manager, scheduler, kwok GPU nodes, runner).")
    ap.add_argument("--state-dir", type=Path, default=DEFAULT_STATE)
    ap.add_argument("--gpu-nodes", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--venv", type=Path, default=None, help="venv whose bin/ pods get on PATH")
    args = ap.parse_args(argv)
    if (args.state_dir / "state.json").exists():
        print(f"a cluster is already up in {args.state_dir}; run e2e/cluster/down first", file=sys.stderr)
        return 1
    c = LocalCluster(args.state_dir, gpu_nodes=args.gpu_nodes, gpus_per_node=args.gpus_per_node, venv=args.venv,
                     tie_to_parent=False)
    c.start()
    import atexit
    atexit.unregister(c.stop)  # `up` leaves it running; `down` stops it
    print(f"cluster up in {c.startup_seconds:.0f} s; logs in {args.state_dir / 'logs'}", file=sys.stderr)
    print(f"export KUBECONFIG={c.kubeconfig} PATH={c.bin_dir}:$PATH", file=sys.stderr)
    print(c.kubeconfig)
    return 0


def down(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="e2e/cluster/down", description="Stop the cluster that `up` started.")
    ap.add_argument("--state-dir", type=Path, default=DEFAULT_STATE)
    ap.add_argument("--purge", action="store_true", help="also delete the state directory")
    args = ap.parse_args(argv)
    if not (args.state_dir / "state.json").exists():
        print(f"no cluster in {args.state_dir}", file=sys.stderr)
        return 0
    c = LocalCluster.from_state(args.state_dir)
    c.stop()
    left = procs.marked(c.cluster_id)
    if args.purge:
        import shutil
        shutil.rmtree(args.state_dir, ignore_errors=True)
    print(f"cluster stopped{'; processes left: ' + str(left) if left else ''}", file=sys.stderr)
    return 1 if left else 0
