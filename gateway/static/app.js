// Herald's browser page. Every job row and the live feed come from ONE tenant event
// stream (POST /events/link, then EventSource): browsers allow about six connections per
// origin, so the page never opens a stream per job. GET /jobs is the truth the page
// reconciles with whenever the stream (re)opens. Server text reaches the DOM only through
// textContent and attributes, never as markup.
"use strict";

const KEY_STORAGE = "herald.apiKey";
const TITLES_STORAGE = "herald.titles";
const EVENT_TYPES = [
  "job.queued", "job.running", "job.progress", "job.cancel_requested",
  "job.succeeded", "job.failed", "job.cancelled", "job.snapshot",
];
const LIST_LIMIT = 50;      // jobs read on each reconcile (newest first)
const FEED_LIMIT = 50;      // entries kept in the live feed
const TITLES_LIMIT = 100;   // titles remembered for jobs started here
const OUTPUT_STORAGE = "herald.output";  // the watched job's output so far (sessionStorage)
const OUTPUT_KEEP = 200000;              // characters of output kept across a reload
const TERMINAL_TYPES = ["job.succeeded", "job.failed", "job.cancelled"];
const REOPEN_FIRST_MS = 500;
const REOPEN_MAX_MS = 10000;

const $ = (id) => document.getElementById(id);

const state = {
  key: localStorage.getItem(KEY_STORAGE) || "",
  jobs: new Map(),          // job id -> {status, resultUrl, row}
  titles: loadTitles(),     // job id -> title (the status object does not carry params)
  source: null,             // the one EventSource
  lastEventId: null,        // tenant cursor of the last event seen: where a new stream resumes
  generation: 0,            // bumped by every (re)connect so stale callbacks do nothing
  reopenDelay: REOPEN_FIRST_MS,
  reopenTimer: 0,
  pendingStart: null,       // {body, key}: a retried start reuses its Idempotency-Key
  output: loadOutput(),     // {jobId, lastN, text, ended}: the job whose output is shown
  outputSource: null,       // its EventSource (one at a time, besides the tenant stream)
  outputGeneration: 0,
};

// ----- the API ------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, problem) {
    super((problem && problem.detail) || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

async function api(method, path, { body, idempotencyKey } = {}) {
  const headers = { Authorization: `Bearer ${state.key}`, Accept: "application/json" };
  const init = { method, headers, cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = body;
  }
  if (idempotencyKey) headers["Idempotency-Key"] = idempotencyKey;
  const response = await fetch(path, init);
  const data = await response.json().catch(() => null);
  if (!response.ok) throw new ApiError(response.status, data);
  return data;
}

function uuid4() {
  // crypto.randomUUID exists only in secure contexts; this works on plain http too.
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const hex = Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

// ----- the one tenant stream ----------------------------------------------------------

function setConnection(name, text) {
  const el = $("connection");
  el.dataset.state = name;
  el.textContent = text;
}

function disconnect() {
  state.generation += 1;
  clearTimeout(state.reopenTimer);
  if (state.source) state.source.close();
  state.source = null;
}

async function connect() {
  disconnect();
  const generation = state.generation;
  setConnection("connecting", "Connecting…");
  let link;
  try {
    link = await api("POST", "/events/link");
  } catch (err) {
    if (generation !== state.generation) return;
    if (err instanceof ApiError && err.status === 401) {
      setConnection("error", "API key not accepted");
      return;
    }
    scheduleReopen(generation);  // the gateway is down or restarting
    return;
  }
  if (generation !== state.generation) return;
  let url = link.url;
  // A browser cannot set Last-Event-ID on a new EventSource: resume by query instead.
  if (state.lastEventId !== null) url += `&last_event_id=${encodeURIComponent(state.lastEventId)}`;
  const source = new EventSource(url);
  state.source = source;
  source.addEventListener("open", () => {
    if (generation !== state.generation) return;
    state.reopenDelay = REOPEN_FIRST_MS;
    setConnection("live", "Live");
    reconcile();  // whatever happened while we were away, the status resource knows
  });
  source.addEventListener("error", () => {
    if (generation !== state.generation) return;
    if (source.readyState === EventSource.CLOSED) {
      // EventSource gave up for good (an expired link answers 403, or the gateway
      // stayed away): a fresh link, resuming from the last event seen.
      source.close();
      scheduleReopen(generation);
    } else {
      setConnection("reconnecting", "Reconnecting…");  // EventSource retries by itself
    }
  });
  for (const type of EVENT_TYPES) source.addEventListener(type, onEvent);
}

function scheduleReopen(generation) {
  if (generation !== state.generation) return;
  setConnection("reconnecting", "Reconnecting…");
  clearTimeout(state.reopenTimer);
  const delay = state.reopenDelay * (0.8 + Math.random() * 0.4);
  state.reopenDelay = Math.min(state.reopenDelay * 2, REOPEN_MAX_MS);
  state.reopenTimer = setTimeout(() => {
    if (generation === state.generation) connect();
  }, delay);
}

function onEvent(event) {
  let status;
  try {
    status = JSON.parse(event.data);
  } catch {
    return;
  }
  if (event.lastEventId) state.lastEventId = event.lastEventId;
  const entry = applyStatus(status, null);
  addFeedEntry(event.type, status);
  // Events carry unsigned links; the signed result link comes from the status resource.
  if (entry && status.state === "succeeded" && !entry.resultUrl) reconcile();
}

// ----- reconciling with GET /jobs -----------------------------------------------------

let reconciling = null;
let reconcileAgain = false;

function reconcile() {
  if (reconciling) {
    reconcileAgain = true;  // one more read after the one in flight, never two at once
    return reconciling;
  }
  reconciling = (async () => {
    try {
      do {
        reconcileAgain = false;
        const list = await api("GET", `/jobs?limit=${LIST_LIMIT}`);
        for (const status of list.items) applyStatus(status, status.links.result);
      } while (reconcileAgain);
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) setConnection("error", "API key not accepted");
      // Otherwise the gateway is away; the next (re)open reconciles again.
    } finally {
      reconciling = null;
    }
  })();
  return reconciling;
}

// ----- jobs table ---------------------------------------------------------------------

// Applies a status unless an equal-or-newer version is already shown (events and reads
// may arrive in any order). resultUrl: a signed result link, from the status resource only.
function applyStatus(status, resultUrl) {
  if (!status || typeof status.id !== "string") return null;
  let entry = state.jobs.get(status.id);
  if (!entry) {
    entry = { status, resultUrl: null, row: createRow(status) };
    state.jobs.set(status.id, entry);
  } else if (status.version < entry.status.version) {
    return entry;
  } else {
    entry.status = status;
  }
  if (resultUrl) entry.resultUrl = resultUrl;
  renderRow(entry);
  return entry;
}

function createRow(status) {
  const row = document.createElement("tr");
  row.dataset.jobId = status.id;
  row.dataset.created = status.created_at;
  const name = document.createElement("th");
  name.scope = "row";
  const title = document.createElement("span");
  const id = document.createElement("code");
  id.textContent = status.id.slice(0, 8);
  id.title = status.id;
  name.append(title, id);
  const stateCell = cell("state");
  const progressCell = cell("progress");
  const bar = document.createElement("progress");
  bar.max = 100;
  const pct = document.createElement("span");
  pct.className = "pct";
  progressCell.append(bar, pct);
  const watchCell = cell("watch");
  const watch = document.createElement("button");
  watch.type = "button";
  watch.textContent = "Watch";
  watch.setAttribute("aria-label", `Watch the output of ${jobLabel(status)}`);
  watch.addEventListener("click", () => watchOutput(status.id));
  watchCell.append(watch);
  row.append(name, stateCell, progressCell, cell("result"), cell("updated"), watchCell);
  // Newest first, like GET /jobs (RFC 3339 UTC timestamps sort as strings).
  const tbody = $("jobs").tBodies[0];
  const after = Array.from(tbody.rows).find((r) => r.dataset.created < status.created_at);
  tbody.insertBefore(row, after || null);
  return row;
}

function cell(className) {
  const td = document.createElement("td");
  td.className = className;
  return td;
}

function jobLabel(status) {
  return state.titles.get(status.id) || status.kind;
}

function renderRow({ status, resultUrl, row }) {
  row.dataset.state = status.state;
  row.cells[0].firstChild.textContent = jobLabel(status);

  let text = status.state;
  if (status.state === "running" && status.cancel_requested) text = "cancelling";
  if (status.state === "failed" && status.error) text = `failed: ${status.error.title}`;
  row.cells[1].textContent = text;

  const bar = row.cells[2].querySelector("progress");
  const pct = row.cells[2].querySelector(".pct");
  const value = status.state === "succeeded" ? 100 : status.progress;
  const ended = status.state === "failed" || status.state === "cancelled";
  if ((value === null || value === undefined) && ended) {
    bar.value = 0;  // ended with no progress: still, not busy
    pct.textContent = "";
  } else if (value === null || value === undefined) {
    bar.removeAttribute("value");  // indeterminate: work still to come
    pct.textContent = "";
  } else {
    bar.value = value;
    pct.textContent = `${value}%`;
  }
  bar.setAttribute("aria-label", `Progress of ${jobLabel(status)}`);

  const result = row.cells[3];
  if (status.state === "succeeded" && resultUrl) {
    const link = result.querySelector("a");
    if (link) link.href = resultUrl;  // freshly signed; updated in place so focus stays
    else result.replaceChildren(resultLink(status, resultUrl));
  } else if (status.state === "succeeded") {
    result.textContent = "preparing link…";
  } else {
    result.textContent = "—";
  }

  const updated = new Date(status.updated_at);
  const time = document.createElement("time");
  time.dateTime = status.updated_at;
  time.textContent = updated.toLocaleTimeString();
  row.cells[4].replaceChildren(time);
}

function resultLink(status, url) {
  const a = document.createElement("a");
  a.href = url;
  a.download = "";
  a.textContent = status.kind === "report" ? "Download PDF" : "Download";
  a.setAttribute("aria-label", `Download the result of ${jobLabel(status)}`);
  a.addEventListener("click", async (event) => {
    // The signed link expires (exp=, Unix seconds): take a fresh one before using it.
    const exp = Number(new URL(a.href).searchParams.get("exp"));
    if (exp && exp * 1000 > Date.now() + 5000) return;
    event.preventDefault();
    await reconcile();
    const entry = state.jobs.get(status.id);
    if (entry && entry.resultUrl) location.assign(entry.resultUrl);
  });
  return a;
}

// ----- streamed output (GET /jobs/{id}/output) -------------------------------------------
// One job's output at a time, from its signed links.output (EventSource cannot send a key).
// What was shown is kept in sessionStorage with the last chunk's number, so after a reload
// the page shows it again and resumes the stream after that chunk (last_event_id).

function loadOutput() {
  try {
    const saved = JSON.parse(sessionStorage.getItem(OUTPUT_STORAGE) || "null");
    if (saved && typeof saved.jobId === "string") return saved;
  } catch {
    // nothing usable kept
  }
  return null;
}

function saveOutput() {
  const output = state.output;
  if (!output) {
    sessionStorage.removeItem(OUTPUT_STORAGE);
    return;
  }
  if (output.text.length > OUTPUT_KEEP) output.text = output.text.slice(-OUTPUT_KEEP);
  sessionStorage.setItem(OUTPUT_STORAGE, JSON.stringify(output));
}

function stopOutput() {
  state.outputGeneration += 1;
  if (state.outputSource) state.outputSource.close();
  state.outputSource = null;
}

function watchOutput(jobId) {
  if (!state.output || state.output.jobId !== jobId) {
    state.output = { jobId, lastN: 0, text: "", ended: false };
    saveOutput();
  }
  renderOutput();
  openOutput();
}

function renderOutput() {
  const output = state.output;
  $("output").textContent = output ? output.text : "";
  if (!output) return;
  const label = state.jobs.has(output.jobId) ? jobLabel(state.jobs.get(output.jobId).status) : "job";
  const tail = output.ended ? ` (${output.ended})` : "";
  $("output-job").textContent = `${label} ${output.jobId.slice(0, 8)}${tail}`;
}

async function openOutput() {
  stopOutput();
  const output = state.output;
  if (!output || output.ended || !state.key) return;
  const generation = state.outputGeneration;
  const path = `/jobs/${encodeURIComponent(output.jobId)}`;
  const headers = { Authorization: `Bearer ${state.key}`, Accept: "application/json" };
  let status = null;
  try {
    // A succeeded job answers 303 to its result: not followed, it means the job has ended.
    const response = await fetch(path, { headers, cache: "no-store", redirect: "manual" });
    if (generation !== state.outputGeneration) return;
    if (response.type === "opaqueredirect" || response.status === 303) {
      await finishOutput(output, path, headers, "succeeded");
      return;
    }
    if (response.status === 404 || response.status === 410) {
      output.ended = response.status === 410 ? "gone" : "not found";
      saveOutput();
      renderOutput();
      return;
    }
    if (!response.ok) throw new ApiError(response.status, null);
    status = await response.json();
  } catch {
    if (generation !== state.outputGeneration) return;
    setTimeout(() => { if (generation === state.outputGeneration) openOutput(); }, 2000);
    return;
  }
  if (generation !== state.outputGeneration || !status || !status.links || !status.links.output) return;
  let url = status.links.output;
  if (output.lastN) url += `&last_event_id=${output.lastN}`;
  const source = new EventSource(url);
  state.outputSource = source;
  source.addEventListener("output", (event) => {
    if (generation !== state.outputGeneration) return;
    const n = Number(event.lastEventId);
    if (!(n > output.lastN)) return;  // already shown
    let value;
    try {
      value = JSON.parse(event.data);
    } catch {
      return;
    }
    output.lastN = n;
    output.text += typeof value === "string" ? value : `${JSON.stringify(value)}\n`;
    saveOutput();
    renderOutput();
  });
  const ended = (event) => {
    if (generation !== state.outputGeneration) return;
    output.ended = event.type.replace("job.", "");
    saveOutput();
    renderOutput();
    stopOutput();
  };
  for (const type of TERMINAL_TYPES) source.addEventListener(type, ended);
  source.addEventListener("error", () => {
    if (generation !== state.outputGeneration) return;
    // EventSource retries by itself; once it gave up (a 204 at the end, an expired link's
    // 403), read the status again: a fresh link, or the job has ended.
    if (source.readyState === EventSource.CLOSED) {
      stopOutput();
      setTimeout(() => { if (generation + 1 === state.outputGeneration) openOutput(); }, 1000);
    }
  });
}

// A finished job: the rest of its output at once (NDJSON after the last chunk shown).
async function finishOutput(output, path, headers, how) {
  const response = await fetch(`${path}/output?after=${output.lastN}`, { headers, cache: "no-store" });
  if (!response.ok) return;
  for (const line of (await response.text()).split("\n")) {
    if (!line) continue;
    const chunk = JSON.parse(line);
    if (!(chunk.n > output.lastN)) continue;
    output.lastN = chunk.n;
    output.text += typeof chunk.data === "string" ? chunk.data : `${JSON.stringify(chunk.data)}\n`;
  }
  output.ended = how;
  saveOutput();
  renderOutput();
}

// ----- live feed ----------------------------------------------------------------------

function addFeedEntry(type, status) {
  const item = document.createElement("li");
  item.dataset.jobId = status.id;
  item.dataset.version = status.version;
  item.dataset.type = type;
  const time = document.createElement("time");
  time.dateTime = status.updated_at;
  time.textContent = new Date(status.updated_at).toLocaleTimeString();
  let text = `${type} · ${jobLabel(status)} · ${String(status.id).slice(0, 8)}`;
  if (type === "job.progress" && status.progress !== null) text += ` · ${status.progress}%`;
  item.append(time, document.createTextNode(text));
  const feed = $("feed");
  feed.prepend(item);
  while (feed.children.length > FEED_LIMIT) feed.lastElementChild.remove();
}

// ----- forms --------------------------------------------------------------------------

function loadTitles() {
  try {
    return new Map(JSON.parse(localStorage.getItem(TITLES_STORAGE) || "[]"));
  } catch {
    return new Map();
  }
}

function rememberTitle(jobId, title) {
  state.titles.set(jobId, title);
  const kept = Array.from(state.titles).slice(-TITLES_LIMIT);
  localStorage.setItem(TITLES_STORAGE, JSON.stringify(kept));
}

function problemText(err) {
  if (!(err instanceof ApiError)) return "The gateway could not be reached; try again.";
  const problem = err.problem || {};
  if (Array.isArray(problem.errors) && problem.errors.length) {
    return problem.errors.map((e) => `${e.field}: ${e.message}`).join("; ");
  }
  return problem.detail || problem.title || `HTTP ${err.status}`;
}

function resetView() {
  stopOutput();
  state.output = null;
  saveOutput();
  renderOutput();
  $("output-job").textContent = "Choose “Watch” on a job to see its output as it is written.";
  state.jobs.clear();
  state.lastEventId = null;
  $("jobs").tBodies[0].replaceChildren();
  $("feed").replaceChildren();
}

function onKeySubmit(event) {
  event.preventDefault();
  state.key = $("api-key").value.trim();
  if (!state.key) return;
  localStorage.setItem(KEY_STORAGE, state.key);
  resetView();
  connect();
}

function onForgetKey() {
  disconnect();
  localStorage.removeItem(KEY_STORAGE);
  state.key = "";
  $("api-key").value = "";
  resetView();
  setConnection("idle", "Not connected");
}

async function onReportSubmit(event) {
  event.preventDefault();
  const form = event.currentTarget;
  const error = $("form-error");
  error.textContent = "";
  if (!state.key) {
    error.textContent = "Enter the API key first.";
    return;
  }
  const title = $("title").value;
  const body = JSON.stringify({ title, pages: Number($("pages").value) });
  // Same body after a failed attempt: same Idempotency-Key, so a start that did reach
  // the gateway is not queued twice.
  if (!state.pendingStart || state.pendingStart.body !== body) state.pendingStart = { body, key: uuid4() };
  const submit = form.querySelector("button[type=submit]");
  submit.disabled = true;
  try {
    const status = await api("POST", "/reports", { body, idempotencyKey: state.pendingStart.key });
    state.pendingStart = null;
    rememberTitle(status.id, title);
    applyStatus(status, status.links.result);
    watchOutput(status.id);  // its pages appear in the output as they are rendered
  } catch (err) {
    error.textContent = problemText(err);
  } finally {
    submit.disabled = false;
  }
}

function start() {
  $("api-key").value = state.key;
  $("key-form").addEventListener("submit", onKeySubmit);
  $("forget-key").addEventListener("click", onForgetKey);
  $("report-form").addEventListener("submit", onReportSubmit);
  // Back online after the network dropped: do not wait for the backoff timer.
  window.addEventListener("online", () => {
    if (state.key && (!state.source || state.source.readyState === EventSource.CLOSED)) connect();
  });
  if (state.key) connect();
  if (state.key && state.output) {
    renderOutput();
    openOutput();  // after a reload: what was shown, then the rest after its last chunk
  }
}

start();
