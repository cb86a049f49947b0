"""What every handler shares: validated settings and one Kubernetes client (created lazily, so
importing the handlers needs no cluster)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from anneal.operator.kube import Kube
from anneal.operator.settings import OperatorSettings


@dataclass
class Context:
    settings: OperatorSettings
    _kube: Kube | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def kube(self) -> Kube:
        with self._lock:
            if self._kube is None:
                self._kube = Kube()
            return self._kube
