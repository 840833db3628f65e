// Herald's webhook portal. Everything it shows and does goes through the documented
// /webhooks API (and POST /portal/session to open a portal link), with the tenant's API
// key or a portal session token. It stays live over one stream of notices
// (POST /webhooks/events/link, then EventSource): each notice says "this endpoint's
// deliveries changed", and the page reads them again from the API, which is the truth.
// Server text reaches the DOM only through textContent and attributes, never as markup.
"use strict";

const KEY_STORAGE = "herald.apiKey";            // shared with the page at /
const SESSION_STORAGE = "herald.portalSession"; // a portal link's session: this tab only
// The job event types an endpoint can subscribe to (SPEC §7); all but job.progress by default.
const EVENT_TYPES = [
  "job.queued", "job.running", "job.progress", "job.cancel_requested",
  "job.succeeded", "job.failed", "job.cancelled",
];
const DEFAULT_EVENT_TYPES = EVENT_TYPES.filter((t) => t !== "job.progress");
const PAGE_SIZE = 25;
const MAX_REFRESH = 100;      // the most deliveries one re-read fetches (the API's limit)
// Notices in a burst become one re-read: at most one per interval, however busy the tenant
// (a throttle, not a debounce: a steady stream of notices must not postpone reads forever).
const DELIVERIES_EVERY_MS = 200;
const ENDPOINTS_EVERY_MS = 1000;  // health and last outcome: a heavier read, less urgent
const REOPEN_FIRST_MS = 500;
const REOPEN_MAX_MS = 10000;

const $ = (id) => document.getElementById(id);

const state = {
  auth: null,             // {kind: "key" | "session", token, tenant, expiresAt}
  endpoints: new Map(),   // id -> {endpoint, item}
  selected: null,         // endpoint id whose deliveries are shown
  deliveries: new Map(),  // delivery id -> {delivery, item}
  loaded: PAGE_SIZE,      // how many deliveries the list holds (grows with "Show older")
  nextCursor: null,
  source: null,
  generation: 0,
  reopenDelay: REOPEN_FIRST_MS,
  reopenTimer: 0,
  editing: null,          // endpoint id being edited, null while adding
  endpointWrites: 0,      // endpoint changes this page has applied (see refreshEndpoints)
  returnFocus: null,      // what gets focus back when a dialog closes
};

// ----- the API ------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, problem) {
    super((problem && problem.detail) || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

async function api(method, path, body) {
  const headers = { Accept: "application/json" };
  if (state.auth) headers.Authorization = `Bearer ${state.auth.token}`;
  const init = { method, headers, cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch {
    throw new ApiError(0, null);  // the gateway could not be reached
  }
  const data = response.status === 204 ? null : await response.json().catch(() => null);
  if (!response.ok) {
    if (response.status === 401 && state.auth) {
      signedOut(state.auth.kind === "key" ? "That API key was not accepted."
        : "The portal session has ended: open a fresh portal link.");
    }
    throw new ApiError(response.status, data);
  }
  return data;
}

function problemText(err) {
  if (!(err instanceof ApiError) || err.status === 0) {
    return "The gateway could not be reached. Check the connection and try again.";
  }
  const problem = err.problem || {};
  if (Array.isArray(problem.errors) && problem.errors.length) {
    return problem.errors.map((e) => `${e.field}: ${e.message}`).join("; ");
  }
  return problem.detail || problem.title || `HTTP ${err.status}`;
}

// ----- signing in: an API key, or a portal link exchanged for a session ----------------

function loadSession() {
  try {
    const saved = JSON.parse(sessionStorage.getItem(SESSION_STORAGE) || "null");
    if (saved && saved.token && saved.expiresAt > Date.now()) return { kind: "session", ...saved };
  } catch {
    // unreadable: ignore it
  }
  sessionStorage.removeItem(SESSION_STORAGE);
  return null;
}

async function openPortalLink(params) {
  // The link's query is a credential: take it out of the address bar (and history) at once.
  history.replaceState(null, "", location.pathname);
  try {
    const session = await api("POST", "/portal/session", {
      tenant: params.get("tenant"), key: params.get("key"), exp: params.get("exp"), sig: params.get("sig"),
    });
    const saved = { token: session.token, tenant: session.tenant, expiresAt: Date.now() + session.expires_in * 1000 };
    sessionStorage.setItem(SESSION_STORAGE, JSON.stringify(saved));
    return { kind: "session", ...saved };
  } catch (err) {
    $("access-error").textContent = err instanceof ApiError && err.status === 403
      ? "This portal link has expired or is not valid. Ask whoever gave it to you for a fresh one."
      : problemText(err);
    return null;
  }
}

function signIn(auth) {
  state.auth = auth;
  $("access").hidden = true;
  $("session").hidden = false;
  $("session-text").textContent = auth.kind === "session"
    ? `Webhooks of ${auth.tenant}, opened with a portal link.`
    : "Signed in with an API key.";
  $("endpoints-section").hidden = false;
  refreshEndpoints();
  connect();
}

function signedOut(message) {
  disconnect();
  state.auth = null;
  sessionStorage.removeItem(SESSION_STORAGE);
  resetView();
  $("access").hidden = false;
  $("session").hidden = true;
  $("endpoints-section").hidden = true;
  $("deliveries-section").hidden = true;
  $("access-error").textContent = message || "";
  setConnection("idle", "Not connected");
}

function onSignOut() {
  if (state.auth && state.auth.kind === "key") localStorage.removeItem(KEY_STORAGE);
  $("api-key").value = "";
  signedOut("");
  $("api-key").focus();
}

function onKeySubmit(event) {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  localStorage.setItem(KEY_STORAGE, key);
  $("access-error").textContent = "";
  resetView();
  signIn({ kind: "key", token: key });
}

function resetView() {
  state.endpoints.clear();
  state.deliveries.clear();
  state.selected = null;
  $("endpoints").replaceChildren();
  $("deliveries").replaceChildren();
  $("no-endpoints").hidden = true;
}

// ----- the live stream of notices -----------------------------------------------------

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
    link = await api("POST", "/webhooks/events/link");
  } catch (err) {
    if (generation !== state.generation) return;  // signed out meanwhile (a 401 does that)
    refreshEndpoints();  // says what is wrong
    scheduleReopen(generation);
    return;
  }
  if (generation !== state.generation) return;
  const source = new EventSource(link.url);
  state.source = source;
  source.addEventListener("open", () => {
    if (generation !== state.generation) return;
    state.reopenDelay = REOPEN_FIRST_MS;
    setConnection("live", "Live");
  });
  source.addEventListener("error", () => {
    if (generation !== state.generation) return;
    if (source.readyState === EventSource.CLOSED) {
      source.close();  // gave up for good (an expired link answers 403): a fresh link
      scheduleReopen(generation);
    } else {
      setConnection("reconnecting", "Reconnecting…");
    }
  });
  // The first notice of every (re)connection says "read everything": nothing is replayed.
  source.addEventListener("deliveries", (event) => {
    if (generation !== state.generation) return;
    let notice = {};
    try {
      notice = JSON.parse(event.data);
    } catch {
      // a notice is only a hint: read everything
    }
    changed(notice.endpoint_id ?? null);
  });
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

const timers = { endpoints: 0, deliveries: 0 };

function soon(name, read, delay) {
  if (timers[name]) return;  // a read is already due: it will see this change too
  timers[name] = setTimeout(() => {
    timers[name] = 0;
    read();
  }, delay);
}

function changed(endpointId) {
  soon("endpoints", refreshEndpoints, ENDPOINTS_EVERY_MS);
  if (state.selected && (endpointId === null || endpointId === state.selected)) {
    soon("deliveries", refreshDeliveries, DELIVERIES_EVERY_MS);
  }
}

// One read at a time per list; a request while one runs becomes one more read after it.
function serialized(read) {
  let running = null;
  let again = false;
  return function run() {
    if (running) {
      again = true;
      return running;
    }
    running = (async () => {
      try {
        do {
          again = false;
          await read();
        } while (again);
      } finally {
        running = null;
      }
    })();
    return running;
  };
}

// ----- endpoints ----------------------------------------------------------------------

const refreshEndpoints = serialized(async () => {
  if (!state.auth) return;
  const box = $("endpoints-error");
  let list;
  try {
    // A list asked for before one of this page's own changes was answered may have been read
    // before that change was committed: shown, it would undo the change on the page until the
    // next read. Such a list is read again.
    let writes;
    do {
      writes = state.endpointWrites;
      list = await api("GET", "/webhooks?limit=100");
    } while (writes !== state.endpointWrites);
  } catch (err) {
    if (!state.auth) return;
    box.querySelector("p").textContent = `The endpoints could not be loaded: ${problemText(err)}`;
    box.hidden = false;
    return;
  }
  box.hidden = true;
  const seen = new Set();
  const container = $("endpoints");
  let previous = null;
  for (const endpoint of list.items) {
    seen.add(endpoint.id);
    let entry = state.endpoints.get(endpoint.id);
    if (!entry) {
      entry = { endpoint, item: createEndpointItem(endpoint) };
      state.endpoints.set(endpoint.id, entry);
    }
    entry.endpoint = endpoint;
    renderEndpoint(entry);
    // Newest first, as the API lists them; moved only when out of place (focus stays).
    const wanted = previous ? previous.nextSibling : container.firstChild;
    if (wanted !== entry.item) container.insertBefore(entry.item, wanted);
    previous = entry.item;
  }
  for (const [id, entry] of state.endpoints) {
    if (!seen.has(id)) {
      entry.item.remove();
      state.endpoints.delete(id);
      if (state.selected === id) selectEndpoint(null);
    }
  }
  $("no-endpoints").hidden = list.items.length > 0;
});

function createEndpointItem(endpoint) {
  const item = document.createElement("li");
  item.className = "card";
  item.dataset.endpointId = endpoint.id;
  const article = document.createElement("article");
  const headingId = `endpoint-${endpoint.id}`;
  article.setAttribute("aria-labelledby", headingId);
  const heading = document.createElement("h3");
  heading.id = headingId;
  heading.className = "url";
  const badge = document.createElement("span");
  badge.className = "badge";
  const facts = document.createElement("dl");
  facts.className = "facts";
  const actions = document.createElement("p");
  actions.className = "actions";
  const note = document.createElement("p");
  note.className = "note";
  note.setAttribute("role", "status");
  const button = (label, className, onClick) => {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = label;
    b.className = className;
    b.setAttribute("aria-describedby", headingId);  // "Edit", of which endpoint
    b.addEventListener("click", () => onClick(item.dataset.endpointId, b));
    return b;
  };
  const show = button("Deliveries", "show-deliveries", (id) => selectEndpoint(id, true));
  show.setAttribute("aria-controls", "deliveries-section");
  actions.append(
    show,
    button("Send test event", "send-test", sendTest),
    button("Edit", "edit", (id, b) => openEndpointDialog(id, b)),
    button("Pause", "toggle", togglePause),
    button("Rotate secret", "rotate", rotateSecret),
    button("Delete", "delete danger", confirmDelete),
  );
  article.append(heading, badge, facts, actions, note);
  item.append(article);
  return item;
}

function fact(list, name, value) {
  const dt = document.createElement("dt");
  dt.textContent = name;
  const dd = document.createElement("dd");
  if (value instanceof Node) dd.append(value);
  else dd.textContent = value;
  list.append(dt, dd);
}

function renderEndpoint({ endpoint, item }) {
  const article = item.firstChild;
  item.dataset.status = endpoint.status;
  item.classList.toggle("selected", state.selected === endpoint.id);
  article.querySelector(".url").textContent = endpoint.url;
  const badge = article.querySelector(".badge");
  badge.textContent = endpoint.status === "enabled" ? "Enabled" : "Paused";
  badge.dataset.status = endpoint.status;
  const facts = article.querySelector(".facts");
  facts.replaceChildren();
  fact(facts, "Events", endpoint.event_types.join(", "));
  fact(facts, "Kinds", endpoint.kinds ? endpoint.kinds.join(", ") : "every kind");
  fact(facts, "Signature", endpoint.signature === "ed25519" ? "Ed25519 (v1a)" : "HMAC-SHA256 (v1)");
  const health = endpoint.health;
  const last = health && health.last_delivery;
  fact(facts, "Last delivery", last ? lastDeliveryText(last) : "none yet");
  fact(facts, "Success rate", health && health.success_rate !== null
    ? `${Math.round(health.success_rate * 100)}% of the last ${health.delivered + health.failed} that ended`
    : "no delivery has ended yet");
  const toggle = article.querySelector(".toggle");
  toggle.textContent = endpoint.status === "enabled" ? "Pause" : "Resume";
  article.querySelector(".send-test").disabled = endpoint.status !== "enabled";
  article.querySelector(".show-deliveries").setAttribute("aria-pressed", String(state.selected === endpoint.id));
}

function lastDeliveryText(last) {
  let text = `${last.status} · ${last.type}`;
  if (last.status_code !== null) text += ` · HTTP ${last.status_code}`;
  else if (last.error) text += ` · ${last.error}`;
  return `${text} · ${new Date(last.created_at).toLocaleString()}`;
}

function endpointNote(id, text) {
  const entry = state.endpoints.get(id);
  if (entry) entry.item.querySelector(".note").textContent = text;
}

async function sendTest(id) {
  endpointNote(id, "Sending a test event…");
  try {
    const delivery = await api("POST", `/webhooks/${id}/test`);
    endpointNote(id, `Test event queued (${delivery.event_id}).`);
    if (state.selected !== id) selectEndpoint(id, false);
    else refreshDeliveries();
  } catch (err) {
    endpointNote(id, problemText(err));
  }
}

async function togglePause(id) {
  const entry = state.endpoints.get(id);
  if (!entry) return;
  const status = entry.endpoint.status === "enabled" ? "disabled" : "enabled";
  try {
    entry.endpoint = await api("PATCH", `/webhooks/${id}`, { status });
    state.endpointWrites += 1;
    renderEndpoint(entry);
    endpointNote(id, status === "enabled" ? "Resumed: new events are delivered again."
      : "Paused: new events are dropped and waiting deliveries end failed until you resume.");
    if (state.selected === id) refreshDeliveries();
  } catch (err) {
    endpointNote(id, problemText(err));
  }
}

async function rotateSecret(id, opener) {
  try {
    const key = await api("POST", `/webhooks/${id}/rotate-secret`);
    endpointNote(id, "");
    showSecret(key, "rotated", opener);
  } catch (err) {
    endpointNote(id, problemText(err));
  }
}

function confirmDelete(id, opener) {
  const entry = state.endpoints.get(id);
  if (!entry) return;
  $("confirm-text").textContent = `${entry.endpoint.url} and its delivery log will be deleted. Nothing more is sent to it.`;
  const dialog = $("confirm-dialog");
  dialog.dataset.endpointId = id;
  openDialog(dialog, opener, $("confirm-no"));
}

async function onConfirmDelete() {
  const dialog = $("confirm-dialog");
  const id = dialog.dataset.endpointId;
  closeDialog(dialog, false);
  try {
    await api("DELETE", `/webhooks/${id}`);
    state.endpointWrites += 1;
    const entry = state.endpoints.get(id);
    if (entry) entry.item.remove();
    state.endpoints.delete(id);
    if (state.selected === id) selectEndpoint(null);
    $("no-endpoints").hidden = state.endpoints.size > 0;
    announce("Endpoint deleted.");
    $("add-endpoint").focus();
  } catch (err) {
    endpointNote(id, problemText(err));
    restoreFocus();
  }
}

// ----- the endpoint form --------------------------------------------------------------

function buildEventTypes() {
  const fieldset = $("event-types");
  const hint = $("event-types-hint");
  for (const type of EVENT_TYPES) {
    const label = document.createElement("label");
    const box = document.createElement("input");
    box.type = "checkbox";
    box.name = "event_types";
    box.value = type;
    label.append(box, ` ${type}`);
    fieldset.insertBefore(label, hint);
  }
}

function openEndpointDialog(id, opener) {
  state.editing = id;
  const endpoint = id ? state.endpoints.get(id).endpoint : null;
  $("endpoint-dialog-title").textContent = endpoint ? "Edit endpoint" : "Add endpoint";
  $("endpoint-url").value = endpoint ? endpoint.url : "";
  const chosen = new Set(endpoint ? endpoint.event_types : DEFAULT_EVENT_TYPES);
  for (const box of document.querySelectorAll('#event-types input[type="checkbox"]')) box.checked = chosen.has(box.value);
  $("endpoint-kinds").value = endpoint && endpoint.kinds ? endpoint.kinds.join(", ") : "";
  $("signature-fieldset").hidden = Boolean(endpoint);  // fixed once created
  for (const radio of document.querySelectorAll('input[name="signature"]')) radio.checked = radio.value === "hmac-sha256";
  clearFieldErrors();
  openDialog($("endpoint-dialog"), opener, $("endpoint-url"));
}

const FIELD_ELEMENTS = { url: "endpoint-url", event_types: "event-types", kinds: "endpoint-kinds" };

function clearFieldErrors() {
  $("endpoint-error").textContent = "";
  for (const id of Object.values(FIELD_ELEMENTS)) $(id).removeAttribute("aria-invalid");
}

async function onEndpointSubmit(event) {
  event.preventDefault();
  clearFieldErrors();
  const url = $("endpoint-url").value.trim();
  const eventTypes = Array.from(document.querySelectorAll('#event-types input:checked'), (box) => box.value);
  const kindsText = $("endpoint-kinds").value.trim();
  const kinds = kindsText ? kindsText.split(",").map((k) => k.trim()).filter(Boolean) : null;
  const local = [];
  if (!url) local.push({ field: "url", message: "enter the URL of your receiver" });
  if (!eventTypes.length) local.push({ field: "event_types", message: "choose at least one event type" });
  if (local.length) {
    showFieldErrors(local);
    return;
  }
  const body = { url, event_types: eventTypes, kinds };
  const submit = event.currentTarget.querySelector('button[type="submit"]');
  submit.disabled = true;
  try {
    if (state.editing) {
      const endpoint = await api("PATCH", `/webhooks/${state.editing}`, body);
      state.endpointWrites += 1;
      const entry = state.endpoints.get(endpoint.id);
      if (entry) {
        entry.endpoint = endpoint;
        renderEndpoint(entry);
      }
      closeDialog($("endpoint-dialog"));
      endpointNote(endpoint.id, "Saved.");
    } else {
      body.signature = document.querySelector('input[name="signature"]:checked').value;
      const created = await api("POST", "/webhooks", body);
      closeDialog($("endpoint-dialog"), false);
      await refreshEndpoints();
      selectEndpoint(created.id, false);
      const entry = state.endpoints.get(created.id);
      showSecret(created, "created", entry ? entry.item.querySelector(".show-deliveries") : $("add-endpoint"));
    }
  } catch (err) {
    const problem = (err instanceof ApiError && err.problem) || {};
    if (Array.isArray(problem.errors) && problem.errors.length) showFieldErrors(problem.errors);
    else $("endpoint-error").textContent = problemText(err);
  } finally {
    submit.disabled = false;
  }
}

function showFieldErrors(errors) {
  $("endpoint-error").textContent = errors.map((e) => `${e.field}: ${e.message}`).join("; ");
  let first = null;
  for (const e of errors) {
    const el = $(FIELD_ELEMENTS[e.field] || "");
    if (!el) continue;
    el.setAttribute("aria-invalid", "true");
    first = first || el;
  }
  const target = first && first.tagName === "FIELDSET" ? first.querySelector("input") : first;
  if (target) target.focus();
}

// ----- dialogs ------------------------------------------------------------------------

function openDialog(dialog, opener, focus) {
  state.returnFocus = opener || document.activeElement;
  dialog.showModal();
  if (focus) focus.focus();
}

function closeDialog(dialog, refocus = true) {
  if (dialog.open) dialog.close();
  if (refocus) restoreFocus();
}

function restoreFocus() {
  const target = state.returnFocus;
  state.returnFocus = null;
  if (target && document.contains(target)) target.focus();
}

function showSecret(key, why, opener) {
  const value = key.secret || key.public_key;
  const isPublic = !key.secret;
  $("secret-title").textContent = isPublic ? "Public key" : "Signing secret";
  $("secret-text").textContent = (why === "rotated"
    ? "A new key. The old one keeps signing for 24 hours beside it, so update your receiver within that time. "
    : "The endpoint is ready. ") + (isPublic
    ? "Verify deliveries (v1a signatures) with this public key."
    : "Copy this secret into your receiver now: it is not shown again.");
  $("secret-value").textContent = value;
  $("copy-note").textContent = "";
  openDialog($("secret-dialog"), opener, $("copy-secret"));
}

async function onCopySecret() {
  const value = $("secret-value").textContent;
  try {
    await navigator.clipboard.writeText(value);
    $("copy-note").textContent = "Copied.";
  } catch {
    // No clipboard (plain http, or refused): select it so Ctrl+C copies it.
    const range = document.createRange();
    range.selectNodeContents($("secret-value"));
    const selection = getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    $("copy-note").textContent = "Selected: press Ctrl+C (or ⌘C) to copy.";
  }
}

// ----- deliveries ---------------------------------------------------------------------

function selectEndpoint(id, moveFocus) {
  state.selected = id;
  state.deliveries.clear();
  state.loaded = PAGE_SIZE;
  state.nextCursor = null;
  $("deliveries").replaceChildren();
  $("deliveries-note").textContent = "";
  $("deliveries-error").hidden = true;
  for (const entry of state.endpoints.values()) renderEndpoint(entry);
  const section = $("deliveries-section");
  if (!id) {
    section.hidden = true;
    return;
  }
  section.hidden = false;
  $("deliveries-of").textContent = `To ${state.endpoints.get(id)?.endpoint.url ?? id}, newest first. New ones appear as they happen.`;
  refreshDeliveries();
  if (moveFocus) $("deliveries-heading").focus();
}

function deliveriesPath(limit, cursor) {
  const query = new URLSearchParams({ limit: String(limit) });
  const status = $("status-filter").value;
  if (status) query.set("status", status);
  if (cursor) query.set("cursor", cursor);
  return `/webhooks/${state.selected}/deliveries?${query}`;
}

const refreshDeliveries = serialized(async () => {
  const endpointId = state.selected;
  if (!endpointId || !state.auth) return;
  const box = $("deliveries-error");
  let page;
  try {
    page = await api("GET", deliveriesPath(Math.min(state.loaded, MAX_REFRESH)));
  } catch (err) {
    if (state.selected !== endpointId || !state.auth) return;
    if (err.status === 404) {  // deleted meanwhile (here or elsewhere)
      selectEndpoint(null);
      refreshEndpoints();
      return;
    }
    box.querySelector("p").textContent = `The deliveries could not be loaded: ${problemText(err)}`;
    box.hidden = false;
    return;
  }
  if (state.selected !== endpointId) return;
  box.hidden = true;
  const fresh = [];
  const container = $("deliveries");
  let previous = null;
  for (const delivery of page.items) {
    let entry = state.deliveries.get(delivery.id);
    if (!entry) {
      entry = { delivery, item: createDeliveryItem(delivery) };
      state.deliveries.set(delivery.id, entry);
      if (container.children.length) fresh.push(delivery);
    }
    entry.delivery = delivery;
    renderDelivery(entry);
    const wanted = previous ? previous.nextSibling : container.firstChild;
    if (wanted !== entry.item) container.insertBefore(entry.item, wanted);
    previous = entry.item;
  }
  if (state.loaded <= MAX_REFRESH) {
    // The first page is the whole list: what it no longer holds (filtered out) goes.
    const kept = new Set(page.items.map((d) => d.id));
    for (const [id, entry] of state.deliveries) {
      if (!kept.has(id)) {
        entry.item.remove();
        state.deliveries.delete(id);
      }
    }
    state.nextCursor = page.next_cursor;
  }
  $("more-deliveries").hidden = !state.nextCursor;
  $("no-deliveries").hidden = container.children.length > 0;
  if (fresh.length === 1) announce(`New delivery: ${fresh[0].type}, ${fresh[0].status}.`);
  else if (fresh.length > 1) announce(`${fresh.length} new deliveries.`);
});

async function loadOlder() {
  if (!state.nextCursor) return;
  try {
    const page = await api("GET", deliveriesPath(PAGE_SIZE, state.nextCursor));
    for (const delivery of page.items) {
      if (state.deliveries.has(delivery.id)) continue;
      const entry = { delivery, item: createDeliveryItem(delivery) };
      state.deliveries.set(delivery.id, entry);
      renderDelivery(entry);
      $("deliveries").append(entry.item);
    }
    state.loaded += page.items.length;
    state.nextCursor = page.next_cursor;
    $("more-deliveries").hidden = !state.nextCursor;
  } catch (err) {
    $("deliveries-note").textContent = problemText(err);
  }
}

function createDeliveryItem(delivery) {
  const item = document.createElement("li");
  item.className = "delivery";
  item.dataset.deliveryId = delivery.id;
  const details = document.createElement("details");
  const summary = document.createElement("summary");
  const status = document.createElement("span");
  status.className = "status";
  const type = document.createElement("span");
  type.className = "type";
  const job = document.createElement("span");
  job.className = "job";
  const time = document.createElement("time");
  const count = document.createElement("span");
  count.className = "count";
  summary.append(status, type, job, time, count);
  const body = document.createElement("div");
  body.className = "delivery-body";
  const meta = document.createElement("p");
  meta.className = "meta";
  const attemptsHeading = document.createElement("h4");
  attemptsHeading.textContent = "Attempts";
  const wrap = document.createElement("div");
  wrap.className = "table-wrap";
  wrap.tabIndex = 0;  // scrollable by keyboard on a narrow screen
  wrap.setAttribute("role", "region");
  wrap.setAttribute("aria-label", "Attempts");
  const table = document.createElement("table");
  table.className = "attempts";
  const head = table.createTHead().insertRow();
  for (const name of ["#", "Time", "Status", "Latency", "Error", "Answer (first KiB)"]) {
    const th = document.createElement("th");
    th.scope = "col";
    th.textContent = name;
    head.append(th);
  }
  table.createTBody();
  wrap.append(table);
  const payloadHeading = document.createElement("h4");
  payloadHeading.textContent = "Payload, as signed";
  const pre = document.createElement("pre");
  pre.className = "payload";
  pre.tabIndex = 0;
  body.append(meta, attemptsHeading, wrap, payloadHeading, pre);
  details.append(summary, body);
  const resend = document.createElement("button");
  resend.type = "button";
  resend.className = "resend";
  resend.textContent = "Resend";
  resend.addEventListener("click", () => resendDelivery(item.dataset.deliveryId, resend));
  item.append(details, resend);
  return item;
}

function renderDelivery({ delivery, item }) {
  item.dataset.status = delivery.status;
  item.dataset.type = delivery.type;
  item.dataset.jobId = delivery.job_id || "";
  const summary = item.querySelector("summary");
  summary.querySelector(".status").textContent = delivery.status;
  summary.querySelector(".type").textContent = delivery.type;
  summary.querySelector(".job").textContent = delivery.job_id ? `job ${delivery.job_id.slice(0, 8)}` : "test event";
  const time = summary.querySelector("time");
  time.dateTime = delivery.created_at;
  time.textContent = new Date(delivery.created_at).toLocaleString();
  const n = delivery.attempts.length;
  summary.querySelector(".count").textContent = n === 1 ? "1 attempt" : `${n} attempts`;
  const resend = item.querySelector(".resend");
  resend.setAttribute("aria-label", `Resend ${delivery.type} of ${new Date(delivery.created_at).toLocaleString()}`);

  let meta = `webhook-id ${delivery.event_id}`;
  if (delivery.job_id) meta += ` · job ${delivery.job_id} · version ${delivery.version}`;
  if (delivery.next_attempt_at) meta += ` · next attempt ${new Date(delivery.next_attempt_at).toLocaleTimeString()}`;
  item.querySelector(".meta").textContent = meta;

  const rows = item.querySelector(".attempts").tBodies[0];
  rows.replaceChildren();
  delivery.attempts.forEach((attempt, index) => {
    const row = rows.insertRow();
    row.dataset.statusCode = attempt.status_code === null ? "" : String(attempt.status_code);
    const cells = [
      String(index + 1),
      new Date(attempt.at).toLocaleTimeString(),
      attempt.status_code === null ? "no answer" : String(attempt.status_code),
      attempt.latency_ms === null ? "—" : `${attempt.latency_ms} ms`,
      attempt.error || "—",
      attempt.response === null ? "—" : attempt.response,
    ];
    for (const text of cells) {
      const td = row.insertCell();
      td.textContent = text;
    }
    row.cells[5].className = "answer";
  });
  if (!delivery.attempts.length) {
    const td = rows.insertRow().insertCell();
    td.colSpan = 6;
    td.textContent = delivery.status === "pending" ? "Not attempted yet." : "Never attempted.";
  }
  item.querySelector(".payload").textContent = prettyPayload(delivery.payload);
}

function prettyPayload(payload) {
  if (payload === null) return "(no longer kept)";
  try {
    return JSON.stringify(JSON.parse(payload), null, 2);
  } catch {
    return payload;
  }
}

async function resendDelivery(id, button) {
  button.disabled = true;
  try {
    const delivery = await api("POST", `/webhooks/${state.selected}/deliveries/${id}/retry`);
    $("deliveries-note").textContent = `Resending ${delivery.type} (${delivery.event_id}).`;
    refreshDeliveries();
  } catch (err) {
    $("deliveries-note").textContent = problemText(err);
  } finally {
    button.disabled = false;
  }
}

async function onRecover(event) {
  event.preventDefault();
  const value = $("recover-since").value;
  const since = value ? new Date(value) : null;
  if (!since || Number.isNaN(since.getTime())) {
    $("deliveries-note").textContent = "Choose the time to recover from.";
    $("recover-since").focus();
    return;
  }
  const submit = event.currentTarget.querySelector('button[type="submit"]');
  submit.disabled = true;
  try {
    const result = await api("POST", `/webhooks/${state.selected}/recover`, { since: since.toISOString() });
    $("deliveries-note").textContent = result.count === 0
      ? `No failed deliveries since ${since.toLocaleString()}.`
      : `${result.count} failed ${result.count === 1 ? "delivery is" : "deliveries are"} being sent again.`;
    refreshDeliveries();
  } catch (err) {
    $("deliveries-note").textContent = problemText(err);
  } finally {
    submit.disabled = false;
  }
}

function localInputValue(date) {
  const pad = (n) => String(n).padStart(2, "0");
  return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())}T${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
}

function announce(text) {
  $("live-note").textContent = text;
}

// ----- start --------------------------------------------------------------------------

async function start() {
  buildEventTypes();
  $("key-form").addEventListener("submit", onKeySubmit);
  $("sign-out").addEventListener("click", onSignOut);
  $("add-endpoint").addEventListener("click", (event) => openEndpointDialog(null, event.currentTarget));
  $("endpoint-form").addEventListener("submit", onEndpointSubmit);
  $("endpoint-cancel").addEventListener("click", () => closeDialog($("endpoint-dialog")));
  $("secret-done").addEventListener("click", () => closeDialog($("secret-dialog")));
  $("copy-secret").addEventListener("click", onCopySecret);
  $("confirm-yes").addEventListener("click", onConfirmDelete);
  $("confirm-no").addEventListener("click", () => closeDialog($("confirm-dialog")));
  for (const dialog of document.querySelectorAll("dialog")) {
    dialog.addEventListener("cancel", () => setTimeout(restoreFocus));  // Escape
  }
  $("endpoints-retry").addEventListener("click", () => refreshEndpoints());
  $("deliveries-retry").addEventListener("click", () => refreshDeliveries());
  $("status-filter").addEventListener("change", () => selectEndpoint(state.selected, false));
  $("recover-form").addEventListener("submit", onRecover);
  $("more-deliveries").addEventListener("click", loadOlder);
  $("recover-since").value = localInputValue(new Date(Date.now() - 24 * 3600 * 1000));
  window.addEventListener("online", () => {
    if (state.auth && (!state.source || state.source.readyState === EventSource.CLOSED)) connect();
  });

  const params = new URLSearchParams(location.search);
  let auth = null;
  if (params.has("sig")) auth = await openPortalLink(params);
  else auth = loadSession();
  if (!auth && !params.has("sig")) {
    const key = localStorage.getItem(KEY_STORAGE);
    if (key) auth = { kind: "key", token: key };
  }
  if (auth) signIn(auth);
  else $("api-key").focus();
}

start();
