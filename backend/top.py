"""`hyperharness top`: the dashboard's live view in a terminal (rich), for a server without a browser.

It reads the same JSON the page polls (`GET /dashboard/state` with the proxy's key) and prints the same
strings: integers with thousands separators, percentages as the proxy rounded them (one decimal), so a
number on the page and in `top --once` read the same (tests/proxy/test_dashboard.py checks it).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

DASH = "–"
_SPARK = " ▁▂▃▄▅▆▇█"


def fmt_int(n: Any) -> str:
    return DASH if n is None else f"{int(n):,}"


def fmt_pct(p: Any) -> str:
    return DASH if p is None else f"{float(p):.1f}%"


def fmt_2(x: Any) -> str:
    return DASH if x is None else f"{float(x):.2f}"


def fetch_state(base_url: str, key: str | None, timeout: float = 10.0) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    resp = httpx.get(base_url.rstrip("/") + "/dashboard/state", headers=headers, timeout=timeout)
    if resp.status_code == 401:
        raise RuntimeError("the proxy refused the key (give --key, $HYPERHARNESS_API_KEY or the key file)")
    resp.raise_for_status()
    data: dict[str, Any] = resp.json()
    return data


def _ago(s: float) -> str:
    return f"{round(s)}s ago" if s < 60 else f"{round(s / 60)}m ago" if s < 3600 else f"{round(s / 3600)}h ago"


def engine_rows(e: dict[str, Any], routing: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str]]:
    """(label, value) rows of one engine, as the page's engine card shows them."""
    p, q, a = e["pool"], e["queue"], e["admitted"]
    rows = [("seats", f"{fmt_int(p.get('seats_used'))} / {fmt_int(p.get('seats'))}")]
    if "kv_tokens" in p:
        rows.append(("KV tokens", f"{fmt_int(p['kv_tokens_used'])} / {fmt_int(p['kv_tokens'])} "
                                  f"({fmt_pct(p['kv_usage_pct'])})"))
        if p.get("state_pages_per_seat"):
            rows.append(("state pages", f"{fmt_int(p['state_pages_used'])} / {fmt_int(p['state_pages'])} "
                                        f"({fmt_int(p['state_pages_per_seat'])}/seat)"))
    pool = (f"{fmt_int(p['pool_blocks'])} blocks × {fmt_int(p['block_size'])} tokens" if "pool_blocks" in p
            else DASH)
    pc, sd, en = e["prefix_cache"], e["spec_decode"], e["engine"]
    rows += [
        ("pool", pool),
        ("admitted", _by_class(a)),
        ("queued", _by_class(q)),
        ("engine running / waiting", f"{fmt_int(en['running'])} / {fmt_int(en['waiting'])}"),
        ("prefix cache hits", f"{fmt_int(pc['hits'])} / {fmt_int(pc['queries'])} ({fmt_pct(pc['hit_pct'])})"),
        ("spec-decode acceptance", f"{fmt_pct(sd['acceptance_pct'])} · mean length "
                                   f"{fmt_2(sd['mean_acceptance_length'])}"),
        ("preemptions", fmt_int(en["preemptions"])),
    ]
    for name, series in routing.items():
        mine = [r for r in series if r.get("engine") in (None, e["name"])]
        if mine:
            rows.append((name.replace("_", " "), ", ".join(
                (f"{r['reason']} " if r.get("reason") else "") + fmt_int(r["value"]) for r in mine)))
    return rows


def _by_class(counts: dict[str, int]) -> str:
    return " / ".join(fmt_int(counts[c]) for c in ("interactive", "subagent", "background")) + " (int/sub/bg)"


def session_cells(s: dict[str, Any]) -> list[str]:
    divs = ", ".join(f"{r} ×{n}" for r, n in s["divergences"].items()) or "none"
    return [s["label"], s["harness"], s["priority"], s["engine"], fmt_int(s["turns"]), fmt_pct(s["cache_pct"]),
            f"{fmt_int(s['cached'])} / {fmt_int(s['reprefilled'])} / {fmt_int(s['new'])}",
            fmt_int(s["completion"]), divs, fmt_int(s["restored_reasoning"]), _ago(s["idle_s"])]


def spark(history: list[dict[str, Any]]) -> Text:
    """Per turn, one cell: its height the prompt size, its colour what most of it came from."""
    top = max([t["cached"] + t["reprefilled"] + t["new"] for t in history] or [1]) or 1
    out = Text()
    for t in history:
        size = t["cached"] + t["reprefilled"] + t["new"]
        part = max(("cached", "reprefilled", "new"), key=lambda k: t[k])
        out.append(_SPARK[max(1, round(8 * size / top))], style={"cached": "green", "reprefilled": "yellow",
                                                                 "new": "blue"}[part])
    return out


def render(state: dict[str, Any]) -> RenderableType:
    t = state["totals"]
    head = Text.assemble(("HyperHarness", "bold"), f" · {state.get('model') or ''} · up {round(state['uptime_s'])}s")
    totals = Table(box=None, pad_edge=False)
    cols = [("sessions", fmt_int(t["sessions"])), ("turns", fmt_int(t["turns"])),
            ("prompt tokens from cache", fmt_pct(t["cache_pct"])), ("cached tokens", fmt_int(t["cached"])),
            ("re-prefilled tokens", fmt_int(t["reprefilled"])), ("new tokens", fmt_int(t["new"])),
            ("divergences", fmt_int(sum(t["divergences"].values()))),
            ("reasoning restored", fmt_int(t["restored_reasoning"]))]
    for label, _ in cols:
        totals.add_column(label, justify="right")
    totals.add_row(*(v for _, v in cols))
    parts: list[RenderableType] = [head, totals]
    for e in state["engines"]:
        table = Table(title=f"engine {e['name']} ({'up' if e['up'] else 'down'}) {e['url']}", title_justify="left",
                      show_header=False, box=None)
        table.add_column(style="dim")
        table.add_column()
        for label, value in engine_rows(e, state.get("routing") or {}):
            table.add_row(label, value)
        parts.append(table)
    sessions = Table(title="sessions (cached / re-prefilled / new prompt tokens)", title_justify="left")
    for col in ("session", "harness", "priority", "engine", "turns", "from cache", "cached / re-prefilled / new",
                "generated", "divergences", "restored", "last seen", "per turn"):
        sessions.add_column(col)
    for s in state["sessions"]:
        sessions.add_row(*session_cells(s), spark(s["history"]))
    parts.append(sessions if state["sessions"] else Text("no finished turn yet", style="dim"))
    return Group(*parts)


def top_command(base_url: str, key: str | None, once: bool, interval: float, console: Console | None = None) -> int:
    console = console or Console()
    if once:
        console.print(render(fetch_state(base_url, key)))
        return 0
    with Live(render(fetch_state(base_url, key)), console=console, screen=False, auto_refresh=False) as live:
        while True:
            time.sleep(interval)
            try:
                live.update(render(fetch_state(base_url, key)), refresh=True)
            except (httpx.HTTPError, RuntimeError) as exc:
                live.update(Text(f"cannot read {base_url}: {exc}", style="red"), refresh=True)
