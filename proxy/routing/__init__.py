"""Placement over several engines: which engine serves a turn, decided once per turn.

    engine.py   Engine: one upstream with its own admission (pool geometry) and health; its load
    prefix.py   chained block hashes of what an engine was sent for a session (exact token-prefix overlap)
    state.py    placements and per-engine load: in-process (one replica) or Redis (several replicas)
    policy.py   the policy interface and its implementations: ours (affinity) and the benchmark baselines
    router.py   Router: the policy + state + health checks + metrics + the routing log
No FastAPI here; proxy/app.py builds the engines and the router in its lifespan.
"""

from .engine import Engine, EngineLoad, Health
from .policy import (
    POLICIES,
    AffinityPolicy,
    LeastLoadedPolicy,
    Placement,
    PlacementPolicy,
    RoundRobinPolicy,
    SessionHashPolicy,
    make_policy,
)
from .prefix import block_hashes, overlap_blocks
from .router import Router
from .state import MemoryState, PlacementRecord, RedisState, RoutingState, make_state

__all__ = [
    "POLICIES", "AffinityPolicy", "Engine", "EngineLoad", "Health", "LeastLoadedPolicy", "MemoryState", "Placement",
    "PlacementPolicy", "PlacementRecord", "RedisState", "RoundRobinPolicy", "Router", "RoutingState",
    "SessionHashPolicy", "block_hashes", "make_policy", "make_state", "overlap_blocks",
]
