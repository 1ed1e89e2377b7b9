// The approval page: reads the token from the URL's fragment (#token=...), sends it as a bearer header,
// shows the offered studies and this site's state, and approves or declines (naming the digest shown, a decline
// with its reason) or revokes.
"use strict";

let token = null;

function takeToken() {
  const match = /(?:^|[#&])token=([^&]+)/.exec(window.location.hash);
  if (match) {
    token = decodeURIComponent(match[1]);
    sessionStorage.setItem("cardiofl-site-ui-token", token);
    history.replaceState(null, "", window.location.pathname);  // the token leaves the address bar
  } else {
    token = sessionStorage.getItem("cardiofl-site-ui-token");
  }
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) if (child) node.append(child);
  return node;
}

function say(message, isError = false) {
  const result = document.getElementById("result");
  result.className = isError ? "error" : "";
  result.textContent = message;
}

async function api(path, body) {
  const options = { headers: { Authorization: "Bearer " + token }, cache: "no-store" };
  if (body !== undefined) {
    options.method = "POST";
    options.headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const response = await fetch(path, options);
  const data = await response.json().catch(() => ({}));
  if (response.status === 401) askToken();
  if (!response.ok) throw new Error(typeof data.detail === "string" ? data.detail : "request failed (" + response.status + ")");
  return data;
}

function askToken() {
  document.getElementById("token-form").hidden = false;
}

function facts(pairs) {
  const dl = el("dl");
  for (const [term, value] of pairs) if (value !== null && value !== undefined) dl.append(el("dt", { text: term }), el("dd", {}, value));
  return dl;
}

function studyCard(study) {
  const id = "study-" + study.study_id;
  const stateClass = { approved: "state-approved", declined: "state-declined", "approval outdated": "state-outdated" }[study.state] || "state-awaiting";
  const card = el("article", { class: "study", "aria-labelledby": id + "-title", "data-study": String(study.study_id) });
  card.append(el("h3", { id: id + "-title", tabindex: "-1", text: "Study " + study.study_id + ": " + study.name }));
  card.append(el("p", {}, "This site: ", el("span", { class: "state " + stateClass, "data-field": "state", text: study.state }), " (study " + study.status + ")"));
  const summary = study.summary;
  const leaves = el("ul");
  for (const line of summary.leaves) leaves.append(el("li", { text: line }));
  card.append(facts([
    ["What runs", summary.runs],
    ["What leaves the site", leaves],
    ["Differential privacy", summary.epsilon || "none: the coordinator sees each upload as trained"],
    ["Secure aggregation", summary.adversary === null ? "none" : "protects against a coordinator colluding with up to " + summary.adversary + " site(s)"],
    ["Smallest pooled count", "statistics only from at least " + summary.min_records + " records"],
    ["Digest (compare out of band)", el("code", { id: id + "-digest", "data-field": "digest", text: study.digest })],
  ]));
  if (study.declined) {
    const when = study.state === "declined" ? "Declined" : "Declined an earlier description (digest " + study.declined.digest + ")";
    card.append(el("p", { "data-field": "declined" }, when + " by " + study.declined.declined_by + " at " + study.declined.declined_at + ". Reason: ",
      el("span", { "data-field": "decline-reason", text: study.declined.reason })));
  }
  if (study.changes.length) {
    const changed = el("ul", { "aria-label": "changed terms" });
    for (const path of study.changes) changed.append(el("li", {}, el("code", { text: path })));
    card.append(el("p", { class: "error", text: "Changed since this site approved it (digest " + study.recorded.digest + "):" }), changed);
  }
  const details = el("details", {}, el("summary", { text: "Full description, as `cardiofl site studies` prints it" }));
  const lines = el("ul", { class: "details" });
  for (const line of study.lines) lines.append(el("li", { text: line }));
  details.append(lines);
  card.append(details);
  const actions = el("div", { class: "actions" });
  if (study.state !== "approved") {
    const approve = el("button", { type: "button", "data-action": "approve", "aria-describedby": id + "-digest", text: "Approve study " + study.study_id });
    approve.addEventListener("click", () => act(study, "approve", { digest: study.digest }));
    actions.append(approve);
  }
  if (study.recorded) {
    const revoke = el("button", { type: "button", class: "secondary", "data-action": "revoke", text: "Revoke the approval of study " + study.study_id });
    revoke.addEventListener("click", () => act(study, "revoke", {}));
    actions.append(revoke);
  }
  card.append(actions);
  if (study.state !== "declined") card.append(declineForm(study, id));
  return card;
}

// A decline names the digest shown and a reason, typed in a labelled field; Enter on the button sends it.
function declineForm(study, id) {
  const form = el("form", { class: "decline", "aria-label": "Decline study " + study.study_id });
  const label = el("label", { for: id + "-reason", text: "Reason for declining study " + study.study_id + " (stays at this site)" });
  const reason = el("textarea", { id: id + "-reason", rows: "2", maxlength: "2000", required: "", "data-action": "decline-reason" });
  const button = el("button", { type: "submit", class: "secondary", "data-action": "decline", "aria-describedby": id + "-digest", text: "Decline study " + study.study_id });
  form.append(label, reason, button);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = reason.value.trim();
    if (!text) { say("Give a reason to decline study " + study.study_id + ".", true); reason.focus(); return; }
    act(study, "decline", { digest: study.digest, reason: text });
  });
  return form;
}

function renderSite(site) {
  document.getElementById("site-line").textContent = "Site " + site.site + ": only this computer can open this page.";
  const poll = site.last_poll ? site.last_poll.at + " (" + site.last_poll.age_s + " s ago)" : site.heartbeat_configured ? "no heartbeat yet" : "unknown (heartbeat_file is not set)";
  document.getElementById("site-facts").replaceChildren(...facts([
    ["Site", site.site],
    ["Agent's last poll", poll],
    ["Uploads awaiting the coordinator", site.pending_uploads.length ? site.pending_uploads.join(", ") : "none"],
  ]).childNodes);
  const body = document.querySelector("#approved-table tbody");
  body.replaceChildren(...site.approved.map((row) => el("tr", { "data-key": row.key },
    el("td", { text: String(row.study_id) }), el("td", { text: row.approved_at || "" }), el("td", { text: row.approved_by || "" }),
    el("td", { text: row.latest_round === null ? "none yet" : String(row.latest_round) }), el("td", {}, el("code", { text: row.digest || "" })))));
  document.getElementById("approved-table").hidden = site.approved.length === 0;
  document.getElementById("approved-empty").hidden = site.approved.length !== 0;
  const declines = document.querySelector("#declines-table tbody");
  declines.replaceChildren(...site.declines.map((row) => el("tr", { "data-decline": row.what },
    el("td", { text: row.at || "" }),
    el("td", { text: row.what === "study" ? "study " + row.study_id + " (digest " + (row.digest || "").slice(0, 12) + "…)" : row.study_id === null ? "a task" : "task of study " + row.study_id + " round " + row.round }),
    el("td", { text: row.by || "" }), el("td", { "data-field": "reason", text: row.reason || "" }))));
  document.getElementById("declines-table").hidden = site.declines.length === 0;
  document.getElementById("declines-empty").hidden = site.declines.length !== 0;
}

async function refresh() {
  const data = await api("/api/state");
  const error = document.getElementById("studies-error");
  error.hidden = !data.error;
  error.textContent = data.error || "";
  document.getElementById("studies").replaceChildren(...data.studies.map(studyCard));
  document.getElementById("studies-empty").hidden = data.studies.length !== 0 || Boolean(data.error);
  renderSite(data.site);
  document.body.dataset.loaded = "true";
}

async function act(study, action, body) {
  try {
    const data = await api("/api/studies/" + study.study_id + "/" + action, body);
    await refresh();
    say(data.message);
  } catch (err) {
    say(String(err.message || err), true);
  }
  const heading = document.getElementById("study-" + study.study_id + "-title");
  if (heading) heading.focus();  // keyboard users continue from the study they acted on
}

document.addEventListener("DOMContentLoaded", () => {
  takeToken();
  document.getElementById("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    token = document.getElementById("token-input").value.trim();
    sessionStorage.setItem("cardiofl-site-ui-token", token);
    document.getElementById("token-form").hidden = true;
    refresh().catch((err) => say(String(err.message || err), true));
  });
  if (!token) { askToken(); return; }
  refresh().catch((err) => say(String(err.message || err), true));
});
