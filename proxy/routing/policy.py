"""Placement policies: one interface, `await policy.place(turn_request, prompt_ids) -> Placement`, decided
once per turn. `AffinityPolicy` is ours; the others are the baselines `hyperharness bench route` compares.

Ours, in order:
  sticky        a known session stays on the engine it was placed on (the one holding its prefix);
  moved         ...unless that engine is down or draining, or its admission queue has made a request
                wait past `move_after_wait_s` while another live engine has room: then it goes where a new
                session would, and the tokens the old engine held (exact prefix overlap) are re-prefilled;
  parent        a subagent goes to its parent's engine while that engine has a free seat and carries at
                most one request (per weight) more than the least busy live engine;
  least_loaded  ...else to the live engine with the smallest pool footprint (per weight);
  hash          a new session goes by weighted rendezvous hashing on its session key,
  spill         ...unless that engine's load would exceed `load_factor` x the average (bounded-load
                consistent hashing): then the least loaded engine by pool footprint.
Every policy records what it sent (state.py); the first placement of a session is atomic across replicas.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from proxy.ingress import TurnRequest
from proxy.settings import RoutingConfig

from .engine import Engine, EngineLoad
from .prefix import DIGEST, block_hashes, overlap_blocks
from .state import PlacementRecord, RoutingState


@dataclass(frozen=True, slots=True)
class Placement:
    engine: Engine
    reason: str  # sticky | parent | hash | spill | least_loaded | moved | round_robin
    reprefill_tokens: int = 0  # tokens the previous engine held that the new one must prefill again
    moved_from: str | None = None  # the previous engine when the session changed engines
    hashes: bytes = b""  # the prompt's block chain (the router extends it with the reply)
    placing: int = 0  # its entry in the engine's `Placing` until it asks for admission

    def placed(self) -> None:
        """The turn asks its engine's admission now: from here the scheduler counts it."""
        self.engine.placing.done(self.placing)


class PlacementPolicy(Protocol):
    name: str

    async def place(self, req: TurnRequest, prompt: Sequence[int]) -> Placement: ...


class Fleet:
    """What every policy reads: the engines, the shared state, the summed loads."""

    def __init__(self, engines: Sequence[Engine], state: RoutingState, config: RoutingConfig) -> None:
        self.engines = list(engines)
        self.by_name = {e.name: e for e in self.engines}
        self.state = state
        self.config = config

    def live(self) -> list[Engine]:
        return [e for e in self.engines if e.live] or self.engines  # none live: try them anyway

    async def loads(self) -> dict[str, EngineLoad]:
        return await self.state.loads({e.name: e.local_load() for e in self.engines})


def rendezvous(key: str, engines: Sequence[Engine]) -> list[Engine]:
    """Engines in weighted rendezvous order for `key`: stable per key, and removing an engine moves only
    the keys it held (the consistent-hashing property) with shares proportional to the weights."""
    def score(e: Engine) -> float:
        h = int.from_bytes(hashlib.blake2b(f"{e.name}\x00{key}".encode(), digest_size=8).digest(), "big")
        u = (h + 1) / (2**64 + 1)  # in (0, 1)
        return -e.weight / math.log(u)
    return sorted(engines, key=score, reverse=True)


def least_loaded(engines: Sequence[Engine], loads: dict[str, EngineLoad], key: str = "") -> Engine:
    """Smallest pool footprint per weight; ties go by the key's rendezvous order (deterministic)."""
    order = {e.name: i for i, e in enumerate(rendezvous(key, engines))}
    return min(engines, key=lambda e: (loads[e.name].footprint / e.weight, order[e.name]))


def within_bound(engine: Engine, engines: Sequence[Engine], loads: dict[str, EngineLoad], factor: float) -> bool:
    """Whether one more request keeps `engine` within `factor` x its weighted share of all the requests
    admitted, queued or just placed (this one included): the bound of bounded-load consistent hashing."""
    total = sum(loads[e.name].requests for e in engines) + 1
    share = engine.weight / sum(e.weight for e in engines)
    mine = loads[engine.name].requests + 1
    return mine <= max(1.0, factor * total * share)


def bounded_hash(key: str, engines: Sequence[Engine], loads: dict[str, EngineLoad],
                 factor: float) -> tuple[Engine, str]:
    """Bounded-load consistent hashing: the key's engine unless it would pass the bound; then spill."""
    first = rendezvous(key, engines)[0]
    if within_bound(first, engines, loads, factor):
        return first, "hash"
    return least_loaded(engines, loads, key), "spill"


class _RecordingPolicy:
    """Reads the session's record, lets `choose` decide, writes the new record (atomically when it is the
    session's first) and reports a change of engine with its re-prefilled tokens."""

    name = "base"

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def choose(self, req: TurnRequest, prior: PlacementRecord | None) -> tuple[Engine, str]:
        raise NotImplementedError

    async def place(self, req: TurnRequest, prompt: Sequence[int]) -> Placement:
        fleet, key = self.fleet, req.session.key
        # One engine: no move can happen, so no overlap is ever needed (no hashing on the hot path).
        hashes = block_hashes(prompt, fleet.config.prefix_block_tokens) if len(fleet.engines) > 1 else b""
        prior = await fleet.state.get(key)
        engine, reason = await self.choose(req, prior)
        record = PlacementRecord(engine.name, len(prompt), hashes)
        if prior is None:
            held = await fleet.state.claim(key, record)
            if held.engine != engine.name and held.engine in fleet.by_name:
                return Placement(fleet.by_name[held.engine], "sticky", hashes=hashes)  # another replica won
            return Placement(engine, reason, hashes=hashes)
        await fleet.state.put(key, record)
        if prior.engine == engine.name:
            return Placement(engine, reason, hashes=hashes)
        held_tokens = overlap_blocks(prior.hashes, hashes) * fleet.config.prefix_block_tokens
        return Placement(engine, reason, held_tokens, prior.engine, hashes)


class AffinityPolicy(_RecordingPolicy):
    name = "affinity"

    async def choose(self, req: TurnRequest, prior: PlacementRecord | None) -> tuple[Engine, str]:
        fleet, key = self.fleet, req.session.key
        live = fleet.live()
        loads = await fleet.loads()
        if prior is not None and prior.engine in fleet.by_name:
            own = fleet.by_name[prior.engine]
            if own.live and not self._saturated(own, live, loads):
                return own, "sticky"
            others = [e for e in live if e is not own] or live
            engine, _ = bounded_hash(key, others, loads, fleet.config.load_factor)
            return engine, "moved"
        if req.parent is not None:
            parent = await self._parent_engine(req.parent)
            # with its parent while that engine has a seat and carries at most one request more than the
            # least busy one: a fan-out spreads over the fleet instead of piling onto its parent's engine
            # (measured with `bench route`: children kept within the 1.25x bound made the P90 TTFT
            # 17.5 s against 12.2 s for least-loaded placement of every turn); the one of slack absorbs
            # another replica's load as last published (up to a health period old)
            if (parent is not None and parent.live and _has_seat(loads[parent.name])
                    and _requests(parent, loads) <= min(_requests(e, loads) for e in live) + 1):
                return parent, "parent"
            if parent is not None:
                return least_loaded(live, loads, key), "least_loaded"
        engine, reason = bounded_hash(key, live, loads, fleet.config.load_factor)
        return engine, reason if prior is None else "moved"  # a record naming a removed engine: moved

    def _saturated(self, own: Engine, live: list[Engine], loads: dict[str, EngineLoad]) -> bool:
        """Waited past the stated bound on this engine, while another live engine has room."""
        if loads[own.name].head_wait_s <= self.fleet.config.move_after_wait_s:
            return False
        return any(e is not own and loads[e.name].queued == 0 and loads[e.name].footprint < 1 for e in live)

    async def _parent_engine(self, parent: str) -> Engine | None:
        # The parent id is what the parent sent as its session id (a header, else a body field).
        for key in (f"h:{parent}", f"b:{parent}", parent):
            rec = await self.fleet.state.get(key)
            if rec is not None:
                return self.fleet.by_name.get(rec.engine)
        return None


def _requests(e: Engine, loads: dict[str, EngineLoad]) -> float:
    return loads[e.name].requests / e.weight


def _has_seat(load: EngineLoad) -> bool:
    if load.seats:
        return load.requests < load.seats
    return load.queued == 0 and (not load.pool_blocks or load.footprint < 1)


class RoundRobinPolicy(_RecordingPolicy):
    """Baseline: every turn to the next live engine."""

    name = "round_robin"

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(fleet)
        self._next = itertools.count()

    async def choose(self, req: TurnRequest, prior: PlacementRecord | None) -> tuple[Engine, str]:
        live = self.fleet.live()
        return live[next(self._next) % len(live)], "round_robin"


class SessionHashPolicy(_RecordingPolicy):
    """Baseline: the session key's hash alone (no load bound, no parent link)."""

    name = "session_hash"

    async def choose(self, req: TurnRequest, prior: PlacementRecord | None) -> tuple[Engine, str]:
        return rendezvous(req.session.key, self.fleet.live())[0], "hash"


class LeastLoadedPolicy(_RecordingPolicy):
    """Baseline: every turn to the live engine with the smallest pool footprint."""

    name = "least_loaded"

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(fleet)
        self._tie = itertools.count()

    async def choose(self, req: TurnRequest, prior: PlacementRecord | None) -> tuple[Engine, str]:
        loads = await self.fleet.loads()
        live = self.fleet.live()
        # ties (an idle fleet) go round the engines, not always to the first
        best = min(loads[e.name].footprint for e in live)
        tied = [e for e in live if loads[e.name].footprint == best]
        return tied[next(self._tie) % len(tied)] if len(tied) > 1 else tied[0], "least_loaded"


POLICIES: dict[str, type[_RecordingPolicy]] = {
    p.name: p for p in (AffinityPolicy, RoundRobinPolicy, SessionHashPolicy, LeastLoadedPolicy)
}


def make_policy(name: str, fleet: Fleet) -> PlacementPolicy:
    try:
        return POLICIES[name](fleet)
    except KeyError:
        raise ValueError(f"unknown placement policy {name!r}; one of {sorted(POLICIES)}") from None


__all__ = ["DIGEST", "POLICIES", "Fleet", "Placement", "PlacementPolicy", "make_policy"]
