"""Keeping `serve`'s engines up: an engine that dies is restarted, with bounded retries and backoff, while
the proxy in front keeps running.

An engine crash is the engine's business: the proxy fails the streams in flight with an error event and
places the next turns elsewhere (or queues them until the engine is healthy again), so it is never
restarted for one. Before each restart every process of the dead engine's session is killed and
checked gone (backend/launcher.py), so a SIGKILLed API server never leaves its EngineCore spinning
beside the new one, holding the pool's memory and a core.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .launcher import EngineError, ManagedProcess, wait_healthy


@dataclass(frozen=True)
class RestartPolicy:
    """At most `max_restarts` within `window_s` (a crash loop gives up instead of spinning forever);
    the wait before restart n is backoff_s * 2**(n-1), capped at backoff_max_s."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    health_timeout_s: float = 900.0
    poll_s: float = 0.5

    def backoff(self, attempt: int) -> float:
        return min(self.backoff_s * 2 ** max(attempt - 1, 0), self.backoff_max_s)


@dataclass
class EngineSupervisor:
    proc: ManagedProcess
    health_url: str
    policy: RestartPolicy
    log: Callable[[str], None]
    restarts: deque[float] = field(default_factory=deque, init=False)  # monotonic times, within the window
    recoveries: list[float] = field(default_factory=list, init=False)  # death seen -> healthy, seconds
    failed: bool = field(default=False, init=False)  # gave up: the crash budget is spent

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop` is set: notice the engine's death, clean up after it and bring it back."""
        while not stop.is_set():
            if self.proc.alive:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.policy.poll_s)
                continue
            if not await self._recover(stop):
                self.failed = True
                return

    async def _recover(self, stop: asyncio.Event) -> bool:
        died = time.monotonic()
        while not stop.is_set():
            await self._reap(f"exited (code {self.proc.returncode})")
            now = time.monotonic()
            while self.restarts and now - self.restarts[0] > self.policy.window_s:
                self.restarts.popleft()
            if len(self.restarts) >= self.policy.max_restarts:
                self.log(f"{self.proc.name}: {len(self.restarts)} restarts within {self.policy.window_s:.0f}s; "
                         f"giving up on it (log: {self.proc.log_path})\n{self.proc.log_tail()}")
                return False
            self.restarts.append(now)
            attempt = len(self.restarts)
            delay = self.policy.backoff(attempt)
            self.log(f"{self.proc.name}: restart {attempt}/{self.policy.max_restarts} in {delay:.1f}s")
            try:
                await asyncio.wait_for(stop.wait(), delay)
                return True  # stopping: serve's own shutdown stops everything
            except TimeoutError:
                pass
            self.proc.start()
            try:
                await _until_stopped(stop, wait_healthy(self.health_url, self.proc,
                                                        self.policy.health_timeout_s))
            except EngineError as exc:
                self.log(f"{self.proc.name}: restart {attempt} failed: {str(exc).splitlines()[0]}")
                continue
            if stop.is_set():
                return True
            took = time.monotonic() - died
            self.recoveries.append(took)
            self.log(f"{self.proc.name}: healthy again {took:.1f}s after it died (restart {attempt})")
            return True
        return True

    async def _reap(self, why: str) -> None:
        """Kill whatever the dead engine left in its session (vLLM's EngineCore) and say so; in a thread,
        so the other engines' supervisors go on meanwhile."""
        orphans = self.proc.leftovers()
        left = await asyncio.to_thread(self.proc.stop, 10.0)
        note = f"; killed {len(orphans)} leftover process(es) {orphans}" if orphans else ""
        if left:
            note += f"; STILL RUNNING: {left}"
        self.log(f"{self.proc.name}: {why}{note}")


async def _until_stopped(stop: asyncio.Event, coro) -> None:
    """Run `coro` unless `stop` is set first (then cancel it and return)."""
    task = asyncio.ensure_future(coro)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if not task.done():
        task.cancel()
        return
    task.result()
