// The Sequin view: polls `data` (JSON) and renders it; its buttons POST to `action`.
// Every value is data (errors hold user data): it goes into the page as text (textContent),
// never as markup. The API token is an HttpOnly cookie: this script never sees it.
"use strict";

const REFRESH_MS = 2000;
let timer = null;
let shown = null; // the data on the page (without its time): unchanged data is not rendered again

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function num(value) {
  return value === null || value === undefined ? "" : Number(value).toLocaleString("en-US");
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "";
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
  return `${h}:${String(m).padStart(2, "0")}:${String(r).padStart(2, "0")}`;
}

// An ISO time as "in h:mm:ss" / "h:mm:ss ago" from the snapshot's time (the full time in its title);
// updated on every refresh, also when nothing else changed.
function relative(iso, now) {
  const seconds = (Date.parse(iso) - Date.parse(now)) / 1000;
  return seconds >= 0 ? `in ${duration(seconds)}` : `${duration(-seconds)} ago`;
}

function when(iso, now) {
  if (!iso) return "";
  const td = el("td", relative(iso, now), "when");
  td.dataset.at = iso;
  td.title = iso;
  return td;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) {
    if (cell instanceof Node) {
      tr.appendChild(cell);
    } else {
      const [text, cls] = Array.isArray(cell) ? cell : [cell, ""];
      tr.appendChild(el("td", text, cls));
    }
  }
  return tr;
}

function fill(id, rows, columns) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(...rows);
  if (!rows.length) {
    const td = el("td", "none");
    td.colSpan = columns;
    body.appendChild(row([td]));
  }
}

function button(label, action, sink, group, title) {
  const b = el("button", label);
  b.type = "button";
  b.className = `action-${action}`;
  b.title = title;
  b.addEventListener("click", () => act(action, sink, group, b));
  return b;
}

function notice(text, kind) {
  const n = document.getElementById("notice");
  n.textContent = text;
  n.className = kind || "";
}

function progressCell(b) {
  const td = el("td");
  const bar = el("div", null, b.percent === null ? "bar unknown" : "bar");
  bar.setAttribute("role", "progressbar");
  bar.setAttribute("aria-valuemin", "0");
  bar.setAttribute("aria-valuemax", "100");
  const fillDiv = el("div");
  if (b.percent !== null) {
    bar.setAttribute("aria-valuenow", String(b.percent));
    fillDiv.style.width = `${b.percent}%`;
  }
  bar.appendChild(fillDiv);
  td.appendChild(bar);
  const total = b.rows_total ? ` / ${num(b.rows_total)}` : "";
  const pct = b.percent !== null ? ` (${b.percent.toFixed(1)}%)` : "";
  td.appendChild(el("div", `${num(b.rows_done)}${total} rows${pct}`, "rows"));
  td.title = b.progress;
  return td;
}

function render(data) {
  document.getElementById("updated").textContent = `updated ${new Date(data.generated_at).toLocaleTimeString()}`;
  const same = JSON.stringify({ ...data, generated_at: null });
  if (same === shown) {
    for (const td of document.querySelectorAll("td.when")) td.textContent = relative(td.dataset.at, data.generated_at);
    return;
  }
  shown = same;
  fill(
    "databases",
    data.databases.map((d) =>
      row([
        d.database,
        d.slot,
        d.active === undefined ? "" : d.active ? "yes" : "no",
        [num(d.lag_bytes), "num"],
        [d.rows_per_second === null || d.rows_per_second === undefined ? "" : num(Math.round(d.rows_per_second)), "num"],
        d.last_batch_at ? when(d.last_batch_at, data.generated_at) : "",
        duration(d.heartbeat_age_seconds),
        [[d.error, d.store_error].filter(Boolean).join("; "), "msg error"],
      ]),
    ),
    8,
  );
  fill(
    "sinks",
    data.sinks.map((s) => {
      const actions = el("td");
      if (s.parked) actions.appendChild(button("Retry parked", "retry", s.name, null, "retry this sink's parked messages now"));
      const counts = Object.entries(s.counts || {}).map(([k, v]) => `${num(v)} ${k}`).join(", ");
      const rate = s.rows_per_second === null || s.rows_per_second === undefined ? "" : `${num(Math.round(s.rows_per_second))} rows/s (${s.database})`;
      const lag = [s.lag_bytes === null || s.lag_bytes === undefined ? "" : `${num(s.lag_bytes)} bytes`,
        s.heartbeat_age_seconds === null || s.heartbeat_age_seconds === undefined ? "" : `heartbeat ${duration(s.heartbeat_age_seconds)} ago`]
        .filter(Boolean).join(", ");
      const tr = row([s.name, s.type, s.tables.join(", "), rate, lag, counts, [num(s.parked), "num"], [num(s.discarded), "num"], [s.destination || "", "msg"], actions]);
      tr.dataset.sink = s.name;
      return tr;
    }),
    10,
  );
  fill(
    "backfills",
    data.backfills.map((b) => {
      const tr = row([b.id, b.sink, b.table, b.kind, b.state, progressCell(b),
        [b.rows_per_second === null ? "" : num(Math.round(b.rows_per_second)), "num"],
        [b.eta_seconds === null ? "" : duration(b.eta_seconds), "eta"], [b.error || "", "msg error"]]);
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
      const actions = el("td");
      if (m.state === "parked") {
        actions.appendChild(button("Retry", "retry", m.sink, m.group, "retry this group now (and the sink's other due messages)"));
        actions.appendChild(button("Discard", "discard", m.sink, m.group, "give up this group's parked messages (kept as discarded)"));
      } else {
        actions.appendChild(button("Requeue", "requeue", m.sink, m.group, "put this group's discarded messages back in line"));
      }
      const tr = row([m.sink, m.position, m.group, m.state, [m.attempts, "num"], m.state === "parked" ? when(m.next_attempt_at, data.generated_at) : "", [m.error || "", "msg error"], actions]);
      tr.dataset.sink = m.sink;
      tr.dataset.group = m.group;
      tr.className = "buffered-message";
      return tr;
    }),
    8,
  );
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
  if (action === "discard" && !window.confirm(`Discard the parked messages of ${sink}${group ? ` group ${group}` : ""}?`)) return;
  if (source) source.disabled = true;
  notice(`${action} ${sink}${group ? ` / ${group}` : ""}…`);
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
    notice(`${action} ${sink}${group ? ` / ${group}` : ""}: ${body.message}`, "ok");
  } catch (err) {
    notice(`${action} failed: ${err.message}`, "error");
  }
  refresh();
}

document.addEventListener("DOMContentLoaded", refresh);
