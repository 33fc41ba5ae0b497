"""The router: one placement per turn (the policy), the routing log and metrics, health checks.

`place()` is what proxy/turn.py calls once per turn; `sent()` records the reply the engine now also
holds; `failed()` is told when a turn's engine broke, so the next turn does not wait for the periodic
check to find out. Log line per placement (logger `proxy.routing`; other tools grep it):

    placement session=<short hash> parent=<short hash|-> engine=<name> reason=<reason> reprefill=<n>

With one engine the same rules run (the log and metrics read the same), minus the prefix hashing that
only a move would need. Session ids never appear raw in the log or in metric labels: `short_id` hashes
them (a parent is hashed as the session key it sent, `h:<id>`, so it matches its own placement lines).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter, Gauge

from proxy.ingress import TurnRequest
from proxy.metrics import Children
from proxy.settings import RoutingConfig

from .engine import Engine, Health
from .policy import Fleet, Placement, PlacementPolicy, make_policy, rendezvous
from .prefix import block_hashes
from .state import PlacementRecord, RoutingState, StateUnavailable

log = logging.getLogger("proxy.routing")


def short_id(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=4).hexdigest()


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.placements = Counter("hh_placements", "Turns placed, by engine and reason", ["engine", "reason"],
                                  registry=r)
        self.moves = Counter("hh_session_moves", "Sessions moved to another engine", ["from_engine", "to_engine"],
                             registry=r)
        self.reprefill = Counter("hh_moved_reprefill_tokens",
                                 "Tokens a moved session's new engine prefills again (held by the old one)",
                                 ["engine"], registry=r)
        self.engine_up = Gauge("hh_engine_up", "1 while the engine passes its health checks", ["engine"],
                               registry=r)
        self.child = Children()  # one placement counter child per turn


class Router:
    def __init__(self, engines: Sequence[Engine], *, state: RoutingState, config: RoutingConfig,
                 registry: CollectorRegistry | None = None, policy: str | None = None) -> None:
        if not engines:
            raise ValueError("the router needs at least one engine")
        self.engines = list(engines)
        self.config = config
        self.state = state
        self.fleet = Fleet(self.engines, state, config)
        self.policy: PlacementPolicy = make_policy(policy or config.policy, self.fleet)
        self.metrics = RoutingMetrics(registry or CollectorRegistry())
        self._checker: asyncio.Task[None] | None = None
        for e in self.engines:
            self.metrics.engine_up.labels(e.name).set(1 if e.live else 0)

    async def place(self, req: TurnRequest, prompt: Sequence[int], max_tokens: int = 0) -> Placement:
        # An engine that just broke a turn is checked now, not at the next period.
        for e in self.engines:
            if e.failures and e.live:
                await self._confirm(e)
        # The placement is counted on its engine until it asks for admission (`Turn.open` calls `placed()`).
        if len(self.engines) == 1:
            # One engine: nothing to choose and no record worth keeping (a move needs a second engine,
            # and `sent` keeps none either); this skips the policy's state reads and writes per turn.
            e = self.engines[0]
            p = Placement(e, "only", placing=e.placing.add(e.worst_case_blocks(len(prompt), max_tokens)))
        else:
            p = await self._policy_place(req, prompt)
            p = replace(p, placing=p.engine.placing.add(p.engine.worst_case_blocks(len(prompt), max_tokens)))
        m = self.metrics
        m.child(m.placements, p.engine.name, p.reason).inc()
        if p.moved_from is not None:
            m.moves.labels(p.moved_from, p.engine.name).inc()
            m.reprefill.labels(p.engine.name).inc(p.reprefill_tokens)
        if log.isEnabledFor(logging.INFO):  # its two hashes are not computed for a log nobody keeps
            parent = short_id(f"h:{req.parent}") if req.parent else "-"
            log.info("placement session=%s parent=%s engine=%s reason=%s reprefill=%d",
                     short_id(req.session.key), parent, p.engine.name, p.reason, p.reprefill_tokens)
        return p

    async def _policy_place(self, req: TurnRequest, prompt: Sequence[int]) -> Placement:
        try:
            return await self.policy.place(req, prompt)
        except StateUnavailable as exc:  # Redis down: place by the session's hash alone until it is back
            log.warning("%s; placing by session hash", exc)
            return Placement(rendezvous(req.session.key, self.fleet.live())[0], "hash")

    async def sent(self, session: str, placement: Placement, ids: Sequence[int]) -> None:
        """The turn ended: its engine now holds prompt + reply for the session."""
        if len(self.engines) == 1:
            return
        hashes = block_hashes(ids, self.config.prefix_block_tokens, placement.hashes)
        try:
            await self.state.put(session, PlacementRecord(placement.engine.name, len(ids), hashes))
        except StateUnavailable as exc:  # the turn itself succeeded; only the record is lost
            log.warning("%s; placement of a finished turn not recorded", exc)

    def failed(self, engine: Engine) -> None:
        """A turn's engine broke off (connection lost, 5xx): count a failed check; the next placement
        checks it at once."""
        engine.failures = max(engine.failures, 1)

    # -- health ---------------------------------------------------------------------------------

    async def check(self, engine: Engine) -> bool:
        cfg = self.config
        try:
            resp = await asyncio.wait_for(engine.upstream.relay("GET", "/health", headers={}, body=None),
                                          cfg.health_timeout_s)
            resp.release()
            ok = resp.status == 200
        except Exception:  # any failure to answer is a failed check
            ok = False
        before = engine.health
        if ok:
            engine.failures = 0
            engine.health = Health.UP
        else:
            engine.failures += 1
            if engine.failures >= 2 * cfg.failures_to_drain:
                engine.health = Health.DOWN
            elif engine.failures >= cfg.failures_to_drain:
                engine.health = Health.DRAINING
        if engine.health is not before:
            log.warning("engine %s: %s -> %s", engine.name, before.value, engine.health.value)
            self.metrics.engine_up.labels(engine.name).set(1 if engine.live else 0)
        return ok

    async def _confirm(self, engine: Engine) -> None:
        """An engine that broke a turn: check until it answers or is drained (milliseconds when the
        process is gone: the connection is refused)."""
        while engine.live and engine.failures:
            if not await self.check(engine) and engine.live:
                await asyncio.sleep(0.05)

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_period_s)
            await asyncio.gather(*(self.check(e) for e in self.engines))
            try:
                await self.state.publish_load({e.name: e.local_load() for e in self.engines})
            except Exception as exc:  # shared load is advisory; placement still works
                log.warning("cannot publish engine load: %s", exc)

    async def start(self) -> None:
        if self._checker is None and len(self.engines) > 1:
            self._checker = asyncio.get_running_loop().create_task(self._check_loop())

    async def close(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            await asyncio.gather(self._checker, return_exceptions=True)
            self._checker = None
        await self.state.close()
