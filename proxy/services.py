"""What the routes use, in one object: built by `create_app`'s lifespan (or injected by tests and
benchmarks). No FastAPI here."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.errors import ProxyError
from proxy.ingress import Ingress
from proxy.metrics import Metrics
from proxy.observe import Observer
from proxy.quirks import QuirkLog
from proxy.routing import Router
from proxy.settings import Settings
from proxy.store import SessionStore
from proxy.turn import TurnService
from proxy.upstream import Upstream


@dataclass
class Services:
    settings: Settings
    metrics: Metrics
    quirk_log: QuirkLog
    ingress: Ingress
    upstream: Upstream | None = None
    store: SessionStore | None = None
    turns: TurnService | None = None  # None without a chat format: chat passes through to vLLM
    observer: Observer | None = None  # the operator view: sessions, engines (proxy/observe.py)
    router: Router | None = None  # the engines (one per upstream) and the placement of turns on them

    @classmethod
    def build(cls, settings: Settings) -> Services:
        metrics = Metrics()
        quirk_log = QuirkLog(metrics.registry)
        model = settings.model_name if settings.limits.strict_model else None
        return cls(settings, metrics, quirk_log, Ingress(quirk_log, default_thinking=settings.default_thinking,
                                                         model=model),
                   observer=Observer(metrics))

    def up(self) -> Upstream:
        """The engine for what is not a turn (model info, pass-through): the first live one."""
        if self.router is not None and len(self.router.engines) > 1:
            live = [e for e in self.router.engines if e.live]
            if live:
                return live[0].upstream
        if self.upstream is None:
            raise ProxyError("proxy is starting")
        return self.upstream

    def require_turns(self) -> TurnService:
        if self.turns is None:
            raise ProxyError("this route needs the proxy's chat format (a model_dir in the proxy config)")
        return self.turns

    def view(self) -> Observer:
        if self.observer is None:
            self.observer = Observer(self.metrics)
        return self.observer
