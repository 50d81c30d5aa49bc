// envelope-proxy review page. Vanilla JS, no dependencies. Every value from the API is put
// into the page with textContent / text nodes, never as HTML.
"use strict";

(function () {
  const TOKEN_KEY = "envelope-review-token";
  const POLL_MS = 3000;
  let pollTimer = null;

  const $ = (id) => document.getElementById(id);

  // el("td", {className: "x", dataset: {id: "1"}}, "text", otherNode): children that are not
  // nodes become text nodes.
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (key === "dataset") Object.assign(node.dataset, value);
      else if (key === "className") node.className = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  const json = (value) => JSON.stringify(value, null, 2);
  const epoch = (s) => (typeof s === "number" ? new Date(s * 1000).toISOString() : "");
  const show = (value) => (value === null || value === undefined || value === "" ? "—" : String(value));

  function token() { return sessionStorage.getItem(TOKEN_KEY); }

  class Unauthorized extends Error {}

  async function api(path, options) {
    const opts = Object.assign({ method: "GET" }, options || {});
    const headers = { Accept: "application/json", Authorization: "Bearer " + (token() || "") };
    if (opts.body !== undefined) headers["Content-Type"] = "application/json";
    const resp = await fetch(path, {
      method: opts.method, headers: headers, cache: "no-store", credentials: "omit",
      body: opts.body === undefined ? undefined : JSON.stringify(opts.body),
    });
    let data = null;
    try { data = await resp.json(); } catch (e) { data = null; }
    if (resp.status === 401) throw new Unauthorized((data && data.error) || "token refused");
    if (!resp.ok) {
      const msg = (data && data.error) || resp.statusText || "request failed";
      const err = new Error("HTTP " + resp.status + ": " + msg);
      err.status = resp.status;
      throw err;
    }
    return data;
  }

  function handle(errorId) {
    return (err) => {
      if (err instanceof Unauthorized) { signOut("The token was refused: " + err.message); return; }
      $(errorId).textContent = err.message;
    };
  }

  function flash(text) { $("flash").textContent = text; }

  function fields(dl, pairs) {
    dl.replaceChildren();
    for (const [name, value] of pairs) {
      dl.appendChild(el("dt", {}, name));
      dl.appendChild(el("dd", { dataset: { field: name } }, show(value)));
    }
  }

  // -- policy ---------------------------------------------------------------------------------
  async function loadPolicy() {
    try {
      const p = await api("/v1/policy");
      const last = p.last_reload || {};
      fields($("policy-info"), [
        ["revision", p.revision],
        ["engine", p.engine],
        ["loaded at", epoch(p.loaded_at)],
        ["directory", p.directory],
        ["tools", (p.tools || []).length],
        ["last reload", last.result ? last.result + " (" + show(last.trigger) + ") at " + epoch(last.at) : "none since start"],
        ["reload errors", (last.errors || []).join("\n")],
      ]);
      $("policy-error").textContent = "";
    } catch (err) { handle("policy-error")(err); }
    try {
      const items = await api("/v1/misconfigurations");
      const body = $("misconfig-body");
      body.replaceChildren(...items.map((m) => el("tr", {},
        el("td", {}, show(m.tool)), el("td", {}, show(m.principal)), el("td", {}, show(m.layer)),
        el("td", {}, show(m.kind)), el("td", {}, show(m.reason)))));
      $("misconfig-table").hidden = items.length === 0;
      $("misconfig-empty").hidden = items.length !== 0;
    } catch (err) {
      if (err.status !== 404) handle("policy-error")(err);
    }
  }

  // -- approvals ------------------------------------------------------------------------------
  function approvalCard(a) {
    const reason = el("input", { type: "text", placeholder: "reason (required)", "aria-label": "reason",
      dataset: { role: "reason" } });
    const result = el("p", { className: "error", dataset: { role: "result" } });
    const approve = el("button", { type: "button", className: "approve", dataset: { action: "approve" } }, "Approve");
    const deny = el("button", { type: "button", className: "deny", dataset: { action: "deny" } }, "Deny");
    const decide = async (action) => {
      result.textContent = "";
      if (!reason.value.trim()) { result.textContent = "A reason is required."; reason.focus(); return; }
      approve.disabled = deny.disabled = true;
      try {
        const done = await api("/v1/approvals/" + encodeURIComponent(a.id) + "/" + action,
          { method: "POST", body: { reason: reason.value.trim() } });
        flash("Approval " + done.id + " " + done.state + " by " + show(done.approver) + ": " + show(done.decision_reason));
        card.remove();
        refreshEmpty();
        loadDecisions();
      } catch (err) {
        approve.disabled = deny.disabled = false;
        if (err instanceof Unauthorized) { signOut("The token was refused: " + err.message); return; }
        result.textContent = err.message;
      }
    };
    approve.addEventListener("click", () => decide("approve"));
    deny.addEventListener("click", () => decide("deny"));
    const info = el("dl", {});
    fields(info, [
      ["approval", a.id], ["principal", a.principal], ["run", a.run],
      ["tool", a.upstream + "." + a.tool], ["effect", a.effect], ["why gated", a.reason],
      ["decision", a.decision_id], ["created", epoch(a.created_at)], ["expires", epoch(a.expires_at)],
    ]);
    const card = el("div", { className: "approval", dataset: { approvalId: a.id } },
      info, el("h4", {}, "Arguments"), el("pre", { dataset: { role: "arguments" } }, json(a.arguments)),
      el("div", { className: "actions" }, reason, approve, deny), result);
    return card;
  }

  function refreshEmpty() {
    $("approvals-empty").hidden = $("approvals-list").children.length !== 0;
  }

  async function loadApprovals() {
    let data;
    try {
      data = await api("/v1/approvals?state=pending");
    } catch (err) {
      if (err.status === 404) { $("approvals-error").textContent = "Approvals are not enabled on this proxy."; return; }
      handle("approvals-error")(err);
      return;
    }
    $("approvals-error").textContent = "";
    const list = $("approvals-list");
    const pending = new Set(data.approvals.map((a) => a.id));
    // Keep cards already shown (a reason being typed survives a refresh); add new, drop gone.
    for (const card of Array.from(list.children)) {
      if (!pending.has(card.dataset.approvalId)) card.remove();
    }
    const shown = new Set(Array.from(list.children).map((c) => c.dataset.approvalId));
    for (const a of data.approvals) if (!shown.has(a.id)) list.appendChild(approvalCard(a));
    refreshEmpty();
  }

  // -- decisions ------------------------------------------------------------------------------
  let decisionsSeq = 0;  // only the newest request renders (an older answer may come later)
  async function loadDecisions() {
    const seq = ++decisionsSeq;
    const form = new FormData($("decision-filters"));
    const params = new URLSearchParams();
    for (const [k, v] of form.entries()) if (String(v).trim()) params.set(k, String(v).trim());
    let data;
    try { data = await api("/v1/decisions?" + params.toString()); }
    catch (err) { if (seq === decisionsSeq) handle("decisions-error")(err); return; }
    if (seq !== decisionsSeq) return;
    $("decisions-error").textContent = "";
    $("decisions-body").replaceChildren(...data.decisions.map((d) => el("tr", {
      className: "decision-row", tabindex: "0", dataset: { decisionId: d.decision_id },
      onclick: () => loadDetail(d.decision_id),
      onkeydown: (e) => { if (e.key === "Enter") loadDetail(d.decision_id); },
    },
    el("td", {}, show(d.ts)), el("td", {}, show(d.principal)), el("td", {}, show(d.upstream) + "." + show(d.tool)),
    el("td", { className: "verdict-" + String(d.verdict) }, show(d.verdict)), el("td", {}, show(d.code)),
    el("td", {}, show(d.run)), el("td", {}, el("code", {}, show(d.decision_id))))));
  }

  async function loadDetail(id) {
    let d;
    try { d = await api("/v1/decisions/" + encodeURIComponent(id)); }
    catch (err) { handle("decisions-error")(err); return; }
    for (const row of $("decisions-body").children) row.classList.toggle("selected", row.dataset.decisionId === id);
    const extra = d.extra || {};
    const lat = d.latency_ms || {};
    $("detail-id").textContent = d.decision_id;
    fields($("detail-fields"), [
      ["time", d.ts], ["verdict", d.verdict], ["code", d.code], ["check", d.check], ["rule", d.rule],
      ["reason", d.reason], ["revision", d.revision], ["principal", d.principal], ["session", d.session],
      ["run", d.run], ["tool", show(d.upstream) + "." + show(d.tool)], ["args digest", d.args_digest],
      ["latency ms", "envelope " + show(lat.envelope) + ", upstream " + show(lat.upstream) + ", total " + show(lat.total)],
      ["upstream status", d.upstream_status], ["approval", extra.approval_id], ["grant", extra.grant_id],
      ["approver", extra.approver],
    ]);
    $("detail-args").textContent = "args" in d ? json(d.args) : "not recorded (the tool's policy has log_args off): digest only";
    $("detail-raw").textContent = json(d);
    $("decision-detail").hidden = false;
  }

  // -- shadow ---------------------------------------------------------------------------------
  async function loadShadow() {
    const run = $("s-run").value.trim();
    let data;
    try { data = await api("/v1/shadow?limit=100" + (run ? "&run=" + encodeURIComponent(run) : "")); }
    catch (err) { handle("shadow-error")(err); $("shadow-body").replaceChildren(); return; }
    $("shadow-error").textContent = "";
    $("shadow-body").replaceChildren(...data.records.slice().reverse().map((r) => el("tr", {},
      el("td", {}, show(r.time)), el("td", {}, show(r.run)), el("td", {}, show(r.principal)),
      el("td", {}, show(r.upstream) + "." + show(r.tool)), el("td", {}, show(r.effect)),
      el("td", {}, r.would_need_approval ? "yes" : "no"), el("td", {}, el("code", {}, show(r.decision_id))),
      el("td", {}, el("pre", {}, json(r.arguments))))));
  }

  // -- session --------------------------------------------------------------------------------
  function loadAll() {
    loadPolicy();
    loadApprovals();
    loadDecisions();
    loadShadow();
  }

  function signIn() {
    $("login").hidden = true;
    $("app").hidden = false;
    $("signout").hidden = false;
    loadAll();
    if (pollTimer === null) pollTimer = setInterval(loadApprovals, POLL_MS);
  }

  function signOut(message) {
    sessionStorage.removeItem(TOKEN_KEY);
    if (pollTimer !== null) { clearInterval(pollTimer); pollTimer = null; }
    $("app").hidden = true;
    $("signout").hidden = true;
    $("login").hidden = false;
    $("approvals-list").replaceChildren();
    $("decisions-body").replaceChildren();
    $("shadow-body").replaceChildren();
    $("decision-detail").hidden = true;
    $("login-error").textContent = message || "";
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", async (e) => {
      e.preventDefault();
      const value = $("token").value.trim();
      $("token").value = "";
      if (!value) return;
      sessionStorage.setItem(TOKEN_KEY, value);
      try {
        await api("/v1/decisions?limit=1");
      } catch (err) {
        if (err instanceof Unauthorized) { signOut("The token was refused: " + err.message); return; }
        // Another failure (e.g. no audit log) is shown in its section; the token is accepted.
      }
      $("login-error").textContent = "";
      signIn();
    });
    $("signout").addEventListener("click", () => signOut(""));
    $("policy-refresh").addEventListener("click", loadPolicy);
    $("approvals-refresh").addEventListener("click", loadApprovals);
    $("decision-filters").addEventListener("submit", (e) => { e.preventDefault(); loadDecisions(); });
    $("shadow-filters").addEventListener("submit", (e) => { e.preventDefault(); loadShadow(); });
    if (token()) signIn();
  });
})();
