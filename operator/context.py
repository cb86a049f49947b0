"""What every handler shares: validated settings and one Kubernetes client (created lazily, so
importing the handlers needs no cluster)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from anneal.operator.kube import Kube
from anneal.operator.settings import OperatorSettings


@dataclass
class Context:
    settings: OperatorSettings
    _kube: Kube | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    nodes_ttl: float = 30.0
    _nodes: tuple[float, list[dict[str, Any]]] | None = None

    @property
    def kube(self) -> Kube:
        with self._lock:
            if self._kube is None:
                self._kube = Kube()
            return self._kube

    def nodes(self) -> list[dict[str, Any]]:
        """All nodes, listed at most every `nodes_ttl` seconds (capacity checks run on every
        reconcile of every resource; node capacity changes slowly)."""
        with self._lock:
            cached = self._nodes
        if cached is not None and time.monotonic() - cached[0] < self.nodes_ttl:
            return cached[1]
        nodes = self.kube.list("v1", "Node")
        with self._lock:
            self._nodes = (time.monotonic(), nodes)
        return nodes
