// The Sequin view: polls `data` (JSON) and renders it; its buttons POST to `action`.
// Every value is data (errors hold user data): it goes into the page as text (textContent),
// never as markup. The API token is an HttpOnly cookie: this script never sees it.
// Rows are keyed and patched cell by cell, so a cell that did not change (a button under the
// pointer) stays the same element across refreshes. No window.confirm: Airflow frames the view in
// a sandbox without modals, so Discard asks for a second click instead.
"use strict";

const REFRESH_MS = 2000;
const ARM_MS = 5000;
let timer = null;
const armed = new Map(); // "discard|sink|group" -> until when a second click discards

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function present(value) {
  return value !== null && value !== undefined;
}

function num(value) {
  return present(value) ? Number(value).toLocaleString("en-US") : "";
}

function duration(seconds) {
  if (!present(seconds)) return "";
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
  return `${h}:${String(m).padStart(2, "0")}:${String(r).padStart(2, "0")}`;
}

// An ISO time as "in h:mm:ss" / "h:mm:ss ago" from the snapshot's time, the full time in its title.
function when(iso, now, prefix) {
  const seconds = (Date.parse(iso) - Date.parse(now)) / 1000;
  const span = el("span", `${prefix || ""}${seconds >= 0 ? `in ${duration(seconds)}` : `${duration(-seconds)} ago`}`);
  span.title = iso;
  return span;
}

function cell(content, cls) {
  const td = el("td", null, cls);
  for (const part of Array.isArray(content) ? content : [content]) {
    if (part instanceof Node) td.appendChild(part);
    else if (present(part) && part !== "") td.appendChild(document.createTextNode(String(part)));
  }
  return td;
}

function row(key, cells, cls) {
  const tr = el("tr", null, cls);
  tr.dataset.key = key;
  for (const c of cells) tr.appendChild(c instanceof Node ? c : cell(c));
  return tr;
}

// Put `rows` into the table's body, keeping the rows and cells that did not change.
function fill(id, rows, columns) {
  const body = document.querySelector(`#${id} tbody`);
  if (!rows.length) {
    const td = el("td", "none");
    td.colSpan = columns;
    rows = [row("", [td])];
  }
  const old = new Map([...body.children].map((tr) => [tr.dataset.key, tr]));
  const kept = rows.map((tr) => {
    const current = old.get(tr.dataset.key);
    if (!current || current.cells.length !== tr.cells.length) return tr;
    [...tr.cells].forEach((td, i) => {
      if (!current.cells[i].isEqualNode(td)) current.cells[i].replaceWith(td);
    });
    for (const [name, value] of Object.entries(tr.dataset)) current.dataset[name] = value;
    return current;
  });
  if (kept.length !== body.children.length || kept.some((tr, i) => body.children[i] !== tr)) {
    body.replaceChildren(...kept);
  }
}

function button(label, action, sink, group, title) {
  const key = `${action}|${sink}|${group ?? ""}`;
  const confirming = (armed.get(key) || 0) > Date.now();
  const b = el("button", confirming ? `Click again to ${label.toLowerCase()}` : label, `action-${action}`);
  b.type = "button";
  b.title = title;
  b.addEventListener("click", () => {
    if (action === "discard" && !((armed.get(key) || 0) > Date.now())) {
      armed.set(key, Date.now() + ARM_MS);
      b.textContent = `Click again to ${label.toLowerCase()}`;
      setTimeout(() => {
        armed.delete(key);
        b.textContent = label;
      }, ARM_MS);
      return;
    }
    armed.delete(key);
    act(action, sink, group, b);
  });
  return b;
}

function notice(text, kind) {
  const n = document.getElementById("notice");
  n.textContent = text;
  n.className = kind || "";
}

function progressCell(b) {
  const bar = el("div", null, present(b.percent) ? "bar" : "bar unknown");
  bar.setAttribute("role", "progressbar");
  bar.setAttribute("aria-valuemin", "0");
  bar.setAttribute("aria-valuemax", "100");
  const inner = el("div");
  if (present(b.percent)) {
    bar.setAttribute("aria-valuenow", String(b.percent));
    inner.style.width = `${b.percent}%`;
  }
  bar.appendChild(inner);
  const total = b.rows_total ? ` / ${num(b.rows_total)}` : "";
  const pct = present(b.percent) ? ` (${b.percent.toFixed(1)}%)` : "";
  const td = cell([bar, el("div", `${num(b.rows_done)}${total} rows${pct}`, "rows")]);
  td.title = b.progress;
  return td;
}

function render(data) {
  const now = data.generated_at;
  fill(
    "databases",
    data.databases.map((d) =>
      row(d.database, [
        d.database,
        d.slot,
        present(d.active) ? (d.active ? "yes" : "no") : "",
        cell(num(d.lag_bytes), "num"),
        cell(present(d.rows_per_second) ? num(Math.round(d.rows_per_second)) : "", "num"),
        cell(d.last_batch_at ? when(d.last_batch_at, now) : ""),
        cell(d.heartbeat_at ? when(d.heartbeat_at, now) : ""),
        cell([d.error, d.store_error].filter(Boolean).join("; "), "msg error"),
      ]),
    ),
    8,
  );
  fill(
    "sinks",
    data.sinks.map((s) => {
      const counts = Object.entries(s.counts || {}).map(([k, v]) => `${num(v)} ${k}`).join(", ");
      const rate = present(s.rows_per_second) ? `${num(Math.round(s.rows_per_second))} rows/s (${s.database})` : "";
      const lag = present(s.lag_bytes) ? [`${num(s.lag_bytes)} bytes`] : [];
      if (s.heartbeat_at) lag.push(when(s.heartbeat_at, now, lag.length ? ", heartbeat " : "heartbeat "));
      const retry = s.parked ? button("Retry parked", "retry", s.name, null, "retry this sink's parked messages now") : "";
      const tr = row(s.name, [s.name, s.type, s.tables.join(", "), rate, cell(lag), counts,
        cell(num(s.parked), "num"), cell(num(s.discarded), "num"), cell(s.destination || "", "msg"), cell(retry)]);
      tr.dataset.sink = s.name;
      return tr;
    }),
    10,
  );
  fill(
    "backfills",
    data.backfills.map((b) => {
      const tr = row(String(b.id), [b.id, b.sink, b.table, b.kind, b.state, progressCell(b),
        cell(present(b.rows_per_second) ? num(Math.round(b.rows_per_second)) : "", "num"),
        cell(present(b.eta_seconds) ? duration(b.eta_seconds) : "", "eta"), cell(b.error || "", "msg error")]);
      tr.id = `backfill-${b.id}`;
      return tr;
    }),
    9,
  );
  document.getElementById("buffered-total").textContent =
    data.buffered_total > data.buffered.length ? `(first ${data.buffered.length} of ${num(data.buffered_total)})` : "";
  fill(
    "buffered",
    data.buffered.map((m) => {
      const actions = m.state === "parked"
        ? [button("Retry", "retry", m.sink, m.group, "retry this group now (and the sink's other due messages)"),
          button("Discard", "discard", m.sink, m.group, "give up this group's parked messages (kept as discarded)")]
        : [button("Requeue", "requeue", m.sink, m.group, "put this group's discarded messages back in line")];
      const next = m.state === "parked" && m.next_attempt_at ? when(m.next_attempt_at, now) : "";
      const tr = row(`${m.sink}|${m.position}`, [m.sink, m.position, m.group, m.state, cell(m.attempts, "num"),
        cell(next), cell(m.error || "", "msg error"), cell(actions)], "buffered-message");
      tr.dataset.sink = m.sink;
      tr.dataset.group = m.group;
      return tr;
    }),
    8,
  );
  document.getElementById("updated").textContent = `updated ${new Date(now).toLocaleTimeString()}`;
}

function sessionLost() {
  notice("The API token is no longer accepted: reload the page to enter one.", "error");
  clearTimeout(timer);
  timer = null;
}

async function refresh() {
  clearTimeout(timer);
  try {
    const response = await fetch("data", { credentials: "same-origin", cache: "no-store" });
    if (response.status === 401 || response.status === 403) return sessionLost();
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
  } catch (err) {
    document.getElementById("updated").textContent = `refresh failed: ${err.message}`;
  }
  timer = setTimeout(refresh, REFRESH_MS);
}

async function act(action, sink, group, source) {
  const what = `${action} ${sink}${group ? ` / ${group}` : ""}`;
  if (source) source.disabled = true;
  notice(`${what}…`);
  try {
    const response = await fetch("action", {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ action, sink, group }),
    });
    if (response.status === 401 || response.status === 403) return sessionLost();
    const body = await response.json();
    if (!response.ok) throw new Error(body.detail || `HTTP ${response.status}`);
    notice(`${what}: ${body.message}`, "ok");
  } catch (err) {
    notice(`${what} failed: ${err.message}`, "error");
  }
  if (source) source.disabled = false;
  refresh();
}

document.addEventListener("DOMContentLoaded", refresh);
