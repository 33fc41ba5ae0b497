// The dashboard: polls /dashboard/state once a second (the cookie set at /dashboard/login authenticates
// it) and redraws. No libraries; the per-session chart is inline SVG. Number formats match backend/top.py
// (integers with thousands separators, percentages the server already rounded to one decimal).
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const PERIOD_MS = 1000;

function int(n) { return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"); }
function pct(p) { return p === null || p === undefined ? "–" : Number(p).toFixed(1) + "%"; }
function num2(x) { return x === null || x === undefined ? "–" : Number(x).toFixed(2); }
function ago(s) { return s < 60 ? Math.round(s) + "s ago" : s < 3600 ? Math.round(s / 60) + "m ago" : Math.round(s / 3600) + "h ago"; }

function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "k") el.dataset.k = v; else el.setAttribute(k, v);
  }
  for (const kid of kids) el.append(kid instanceof Node ? kid : String(kid));
  return el;
}

function dl(rows) {
  const d = h("dl");
  for (const [label, value, key] of rows) d.append(h("dt", {}, label), h("dd", key ? { k: key } : {}, value));
  return d;
}

function bar(used, total) {
  const b = h("div", { class: "bar" }), i = h("i");
  i.style.width = total ? Math.min(100, (100 * used) / total).toFixed(1) + "%" : "0%";
  b.append(i);
  return b;
}

function tile(label, value, key) { return h("div", { class: "tile" }, h("b", { k: key }, value), h("span", {}, label)); }

function renderTotals(st) {
  const t = st.totals, el = document.getElementById("totals");
  const divs = Object.values(t.divergences).reduce((a, b) => a + b, 0);
  el.replaceChildren(
    tile("sessions", int(t.sessions), "totals.sessions"),
    tile("turns", int(t.turns), "totals.turns"),
    tile("prompt tokens from cache", pct(t.cache_pct), "totals.cache_pct"),
    tile("cached tokens", int(t.cached), "totals.cached"),
    tile("re-prefilled tokens", int(t.reprefilled), "totals.reprefilled"),
    tile("new tokens", int(t.new), "totals.new"),
    tile("divergences", int(divs), "totals.divergences"),
    tile("reasoning restored", int(t.restored_reasoning), "totals.restored_reasoning"),
  );
}

function engineCard(e, routing) {
  const p = e.pool, k = "e." + e.name + ".";
  const card = h("article", { class: "card", "data-engine": e.name });
  card.append(h("h3", {}, e.name, h("span", { class: "badge " + (e.up ? "up" : "down") }, e.up ? "up" : "down"),
    h("span", { class: "muted" }, e.url)));
  const rows = [];
  rows.push(["seats", int(p.seats_used) + " / " + int(p.seats), k + "seats"]);
  card.append(dl(rows), bar(p.seats_used, p.seats));
  if (p.kv_tokens !== undefined) {
    card.append(dl([["KV tokens", int(p.kv_tokens_used) + " / " + int(p.kv_tokens) + " (" + pct(p.kv_usage_pct) + ")", k + "kv"]]),
      bar(p.kv_tokens_used, p.kv_tokens));
    if (p.state_pages_per_seat) {
      card.append(dl([["state pages", int(p.state_pages_used) + " / " + int(p.state_pages) + " (" + int(p.state_pages_per_seat) + "/seat)", k + "state"]]),
        bar(p.state_pages_used, p.state_pages));
    }
  }
  const q = e.queue, a = e.admitted;
  const more = [
    ["pool", p.pool_blocks !== undefined ? int(p.pool_blocks) + " blocks × " + int(p.block_size) + " tokens" : "–", k + "pool"],
    ["admitted", int(a.interactive) + " / " + int(a.subagent) + " / " + int(a.background) + " (int/sub/bg)", k + "admitted"],
    ["queued", int(q.interactive) + " / " + int(q.subagent) + " / " + int(q.background) + " (int/sub/bg)", k + "queue"],
    ["engine running / waiting", int(e.engine.running) + " / " + int(e.engine.waiting), k + "engine"],
    ["prefix cache hits", int(e.prefix_cache.hits) + " / " + int(e.prefix_cache.queries) + " (" + pct(e.prefix_cache.hit_pct) + ")", k + "prefix"],
    ["spec-decode acceptance", pct(e.spec_decode.acceptance_pct) + " · mean length " + num2(e.spec_decode.mean_acceptance_length), k + "spec"],
    ["preemptions", int(e.engine.preemptions), k + "preemptions"],
  ];
  for (const [name, rows2] of Object.entries(routing || {})) {
    const mine = rows2.filter((r) => r.engine === undefined || r.engine === e.name);
    if (mine.length) more.push([name.replace(/_/g, " "), mine.map((r) => (r.reason ? r.reason + " " : "") + int(r.value)).join(", "), k + name]);
  }
  card.append(dl(more));
  return card;
}

function chart(history) {
  const W = 300, H = 70, svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("class", "chart");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", "prompt tokens per turn: cached, re-prefilled, new");
  const max = Math.max(1, ...history.map((t) => t.cached + t.reprefilled + t.new));
  const slot = W / Math.max(history.length, 8), w = Math.max(2, slot * 0.75);
  history.forEach((t, i) => {
    let y = H;
    for (const part of ["cached", "reprefilled", "new"]) {
      const hgt = (t[part] / max) * (H - 4);
      if (hgt <= 0) continue;
      y -= hgt;
      const r = document.createElementNS(SVG, "rect");
      r.setAttribute("x", (i * slot).toFixed(1)); r.setAttribute("y", y.toFixed(1));
      r.setAttribute("width", w.toFixed(1)); r.setAttribute("height", hgt.toFixed(1));
      r.setAttribute("class", "c-" + part);
      const title = document.createElementNS(SVG, "title");
      title.textContent = `turn ${t.turn}: ${int(t.cached)} cached, ${int(t.reprefilled)} re-prefilled, ${int(t.new)} new` +
        (t.divergence ? ` (diverged: ${t.divergence})` : "") + (t.restored_reasoning ? " (reasoning restored)" : "");
      r.append(title);
      svg.append(r);
    }
  });
  return svg;
}

function sessionCard(s) {
  const k = "s." + s.label + ".";
  const card = h("article", { class: "card", "data-session": s.label });
  card.append(h("h3", {}, s.label, h("span", { class: "badge" }, s.harness), h("span", { class: "badge" }, s.priority),
    h("span", { class: "muted" }, "on " + s.engine + " · " + ago(s.idle_s))));
  const divs = Object.entries(s.divergences).map(([r, n]) => r + " ×" + n).join(", ");
  card.append(dl([
    ["turns", int(s.turns), k + "turns"],
    ["from cache", pct(s.cache_pct), k + "cache_pct"],
    ["cached / re-prefilled / new", int(s.cached) + " / " + int(s.reprefilled) + " / " + int(s.new), k + "tokens"],
    ["generated", int(s.completion), k + "completion"],
    ["divergences", divs || "none", k + "divergences"],
    ["reasoning restored", int(s.restored_reasoning), k + "restored"],
  ]));
  card.append(chart(s.history));
  return card;
}

function render(st) {
  document.getElementById("model").textContent = st.model ? "· " + st.model : "";
  renderTotals(st);
  document.getElementById("engines").replaceChildren(...st.engines.map((e) => engineCard(e, st.routing)));
  const sessions = document.getElementById("sessions");
  if (st.sessions.length) sessions.replaceChildren(...st.sessions.map(sessionCard));
  document.body.dataset.turns = String(st.totals.turns);
}

async function poll() {
  const live = document.getElementById("live"), updated = document.getElementById("updated");
  try {
    const resp = await fetch("/dashboard/state", { credentials: "same-origin", cache: "no-store" });
    if (resp.status === 401) { window.location.assign("/dashboard/login"); return; }
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    render(await resp.json());
    live.className = "dot ok";
    updated.textContent = "live · " + new Date().toLocaleTimeString();
  } catch (err) {
    live.className = "dot bad";
    updated.textContent = "disconnected (" + err.message + ")";
  }
  setTimeout(poll, PERIOD_MS);
}

poll();
