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

  // The same for SVG elements (the picture): attributes only, children as text nodes.
  const SVG_NS = "http://www.w3.org/2000/svg";
  function svg(tag, attrs, ...children) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "dataset") Object.assign(node.dataset, value);
      else node.setAttribute(key, String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  // Every value the page shows passes `show` (text) or `json` (JSON): both write the characters
  // a screen hides or that reorder text (HIDDEN, below) as escapes, in a table cell, a record
  // field, logged arguments or the record as written alike.
  const json = (value) => jsonVisible(JSON.stringify(value, null, 2));
  const epoch = (s) => (typeof s === "number" ? new Date(s * 1000).toISOString() : "");
  const show = (value) => (value === null || value === undefined || value === "" ? "—" : visible(String(value)));
  // "2026-12-01T01:02:03.456789Z" -> "2026-12-01 01:02:03" (the full value stays in `title`).
  const shortTs = (ts) => (typeof ts === "string" && ts.length >= 19 ? ts.slice(0, 10) + " " + ts.slice(11, 19) : show(ts));
  // A decision id in a table cell: its first 12 characters (the whole id is in the row's record).
  const shortId = (id) => (typeof id === "string" && id.length > 13 ? id.slice(0, 12) + "…" : show(id));
  const hhmm = (ts) => (typeof ts === "string" && ts.length >= 16 ? ts.slice(11, 16) + " UTC" : "");

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

  // Characters a screen hides or that reorder text (bidi overrides, zero-width, odd spaces),
  // written as \u{...}: a run id or a reason cannot make the page read as something else.
  const HIDDEN = /[\p{Cf}\p{Co}\p{Cn}\p{Zl}\p{Zp}\u007f-\u009f]|(?! )\p{Zs}/gu;
  const visible = (text) => String(text).replace(HIDDEN,
    (c) => "\\u{" + c.codePointAt(0).toString(16).padStart(4, "0") + "}");
  // The same in JSON text, with JSON's own escapes (a surrogate pair past U+FFFF): still JSON,
  // and the same value.
  const u4 = (n) => "\\u" + n.toString(16).padStart(4, "0");
  const jsonVisible = (text) => String(text).replace(HIDDEN, (c) => {
    const n = c.codePointAt(0);
    return n <= 0xffff ? u4(n) : u4(0xd800 + ((n - 0x10000) >> 10)) + u4(0xdc00 + ((n - 0x10000) & 0x3ff));
  });

  function fields(dl, pairs) {
    dl.replaceChildren();
    for (const [name, value] of pairs) {
      dl.appendChild(el("dt", {}, name));
      dl.appendChild(el("dd", { dataset: { field: name } }, visible(show(value))));
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
    // A list entry may carry a preview of large arguments (`arguments_truncated`): Approve waits
    // until the approval, read by id, shows them whole. Nobody approves what they could not see.
    let whole = a.arguments_truncated !== true;
    const decide = async (action) => {
      result.textContent = "";
      if (action === "approve" && !whole) { result.textContent = "Show the full arguments before approving."; return; }
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
        deny.disabled = false;
        approve.disabled = !whole;
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
    const recent = el("div", { className: "table-wrap", dataset: { role: "recent" } },
      el("p", { className: "empty" }, "Loading…"));
    const args = el("pre", { dataset: { role: "arguments" } },
      typeof a.arguments_text === "string" ? a.arguments_text : json(a.arguments));
    const warning = el("div", {}, hiddenWarning(a.hidden_characters));
    const cut = whole ? null : fullArguments(a, args, warning, () => { whole = true; approve.disabled = false; });
    approve.disabled = !whole;
    const card = el("div", { className: "approval", dataset: { approvalId: a.id } },
      info, el("h4", {}, "Arguments"), cut, warning, args,
      el("h4", {}, "Data-flow evidence"), evidenceBlock(a.evidence, "approval"),
      el("h4", {}, "Recent calls in this run"), recent,
      el("div", { className: "actions" }, reason, approve, deny), result);
    loadRecent(a.id, recent);
    return card;
  }

  // Large arguments come cut in the list (a preview, polled every few seconds): the card says so
  // and shows them whole, read by id, when asked; `done` then lets the approver approve.
  function fullArguments(a, args, warning, done) {
    const note = el("p", { className: "error", dataset: { role: "arguments-cut" } },
      "The arguments (" + show(a.arguments_bytes) + " bytes) are cut in this list: below is their " +
      "start. Show them in full to approve.");
    const button = el("button", { type: "button", dataset: { action: "full-arguments" } }, "Show the full arguments");
    const box = el("div", { className: "actions" }, note, button);
    button.addEventListener("click", async () => {
      button.disabled = true;
      let full;
      try { full = await api("/v1/approvals/" + encodeURIComponent(a.id)); }
      catch (err) {
        button.disabled = false;
        if (err instanceof Unauthorized) { signOut("The token was refused: " + err.message); return; }
        note.textContent = "The full arguments could not be read: " + err.message;
        return;
      }
      // The same call (an approval is bound to its arguments' digest), shown whole.
      if (full.arguments_truncated === true || full.args_digest !== a.args_digest) {
        button.disabled = false;
        note.textContent = "The approval read by id does not hold the listed call's full arguments.";
        return;
      }
      args.textContent = typeof full.arguments_text === "string" ? full.arguments_text : json(full.arguments);
      warning.replaceChildren(...[hiddenWarning(full.hidden_characters)].filter((n) => n !== null));
      box.replaceChildren(el("p", { className: "hint", dataset: { role: "arguments-whole" } },
        "The full arguments (" + show(full.arguments_bytes) + " bytes) are shown below."));
      done();
    });
    return box;
  }

  // The arguments are shown as `arguments_text`: characters a screen hides or that reorder text
  // (bidi overrides, zero-width, odd spaces) are escaped, so what is approved is what runs; where
  // there are any, the approver is told before deciding.
  function hiddenWarning(found) {
    if (!Array.isArray(found) || found.length === 0) return null;
    return el("p", { className: "error", dataset: { role: "hidden-characters" } },
      "Warning: the arguments hold characters that are invisible, reorder text or look like letters of another script, shown escaped: " +
      found.map((h) => show(h.path) + " (" + (h.characters || []).join(", ") + ")").join("; "));
  }

  // Evidence rows ({kind, argument, source, snippet}): what the data-flow check matched.
  function evidenceRows(items, outcome) {
    return (items || []).map((e) => el("tr", { className: "evidence-row" },
      el("td", { dataset: { col: "argument" } }, show(e.argument)),
      el("td", { dataset: { col: "source" } }, show(e.source)),
      el("td", { className: "snippet", dataset: { col: "snippet" } }, visible(show(e.snippet))),
      el("td", { dataset: { col: "kind" } }, show(e.kind)),
      el("td", { dataset: { col: "outcome" } }, outcome)));
  }

  function evidenceBlock(items, role) {
    if (!Array.isArray(items) || items.length === 0) {
      return el("p", { className: "empty", dataset: { role: role + "-evidence" } },
        "None: gated by its effect, not by a data flow.");
    }
    return el("div", { className: "table-wrap" }, el("table", { className: "evidence", dataset: { role: role + "-evidence" } },
      el("thead", {}, el("tr", {}, el("th", {}, "argument"), el("th", {}, "source tool"),
        el("th", {}, "matched snippet"), el("th", {}, "kind"), el("th", {}, "outcome"))),
      el("tbody", {}, ...evidenceRows(items, "flagged"))));
  }

  async function loadRecent(approvalId, box) {
    let data;
    try { data = await api("/v1/approvals/" + encodeURIComponent(approvalId) + "/recent?limit=10"); }
    catch (err) {
      if (err instanceof Unauthorized) { signOut("The token was refused: " + err.message); return; }
      box.replaceChildren(el("p", { className: "error" }, "Recent calls: " + err.message));
      return;
    }
    if (data.decisions.length === 0) {
      box.replaceChildren(el("p", { className: "empty" }, "No earlier call of this run in the audit log."));
      return;
    }
    const rows = data.decisions.map((d) => el("tr", { dataset: { recentId: d.decision_id } },
      el("td", { className: "ts", title: show(d.ts) }, shortTs(d.ts)),
      el("td", {}, show(d.upstream) + "." + show(d.tool)),
      el("td", { className: "verdict-" + String(d.verdict) }, show(d.verdict)),
      el("td", {}, show(d.code)),
      el("td", { className: "reason", title: show(d.reason) }, el("div", { className: "clamp" }, show(d.reason)))));
    const table = el("table", { className: "recent" },
      el("caption", { className: "hint" }, "The last " + data.count + " decisions of run " + show(data.run) +
        (data.truncated ? " (search bounded: older calls not read)" : "")),
      el("thead", {}, el("tr", {}, el("th", {}, "time"), el("th", {}, "tool"), el("th", {}, "verdict"),
        el("th", {}, "code"), el("th", {}, "reason"))),
      el("tbody", {}, ...rows));
    box.replaceChildren(table);
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
    $("approvals-error").textContent = data.truncated
      ? "More approvals are pending than listed here (" + data.approvals.length + " shown): the " +
        "others are read and decided by id through the API or the CLI (the call's refusal and " +
        "the webhook name it)." : "";
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
  let openedId = null;  // the decision whose record is open (focus returns to its row on close)

  // The filters of the form as query parameters; `window` becomes `since` for the table.
  function filterParams(forStats) {
    const form = new FormData($("decision-filters"));
    const params = new URLSearchParams();
    for (const [k, v] of form.entries()) {
      const value = String(v).trim();
      if (!value) continue;
      if (k === "window") params.set(forStats ? "window" : "since", value);
      else if (k === "limit") { if (!forStats) params.set(k, value); }
      else params.set(k, value);
    }
    return params;
  }

  function decisionRow(d) {
    const open = () => loadDetail(d.decision_id);
    return el("tr", {
      className: "decision-row", tabindex: "0", dataset: { decisionId: d.decision_id },
      "aria-label": show(d.verdict) + " " + show(d.code) + ": " + show(d.upstream) + "." + show(d.tool) + ", open the record",
      onclick: open,
      onkeydown: (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); open(); } },
    },
    el("td", { className: "ts", title: show(d.ts) }, shortTs(d.ts)), el("td", {}, show(d.principal)),
    el("td", {}, show(d.upstream) + "." + show(d.tool)),
    el("td", { className: "verdict-" + String(d.verdict) }, show(d.verdict)),
    el("td", { dataset: { col: "code" } }, show(d.code)),
    el("td", { dataset: { col: "rule" } }, show(d.rule)),
    // Long reasons are cut to three lines here (CSS); the record shows them whole.
    el("td", { className: "reason", dataset: { col: "reason" }, title: show(d.reason) },
      el("div", { className: "clamp" }, show(d.reason))),
    el("td", {}, el("div", { className: "run" }, show(d.run))),
    el("td", { title: show(d.decision_id) }, el("code", {}, shortId(d.decision_id))));
  }

  async function loadDecisions() {
    const seq = ++decisionsSeq;
    loadStats(seq);
    let data;
    try { data = await api("/v1/decisions?" + filterParams(false).toString()); }
    catch (err) { if (seq === decisionsSeq) handle("decisions-error")(err); return; }
    if (seq !== decisionsSeq) return;
    $("decisions-error").textContent = "";
    $("decisions-body").replaceChildren(...data.decisions.map(decisionRow));
    for (const row of $("decisions-body").children) row.classList.toggle("selected", row.dataset.decisionId === openedId);
  }

  // -- the picture: decisions per minute by verdict, top refused tools and codes ---------------
  const VERDICTS = ["allow", "deny", "error"];

  async function loadStats(seq) {
    let s;
    try { s = await api("/v1/decision-stats?" + filterParams(true).toString()); }
    catch (err) { if (seq === decisionsSeq) handle("stats-error")(err); return; }
    if (seq !== decisionsSeq) return;
    $("stats-error").textContent = "";
    drawRate(s);
    drawTop($("top-tools"), $("top-tools-empty"), s.top_refused_tools, "tool");
    drawTop($("top-codes"), $("top-codes-empty"), s.top_refused_codes, "code");
  }

  function drawRate(s) {
    const minutes = s.bucket_seconds / 60;
    $("rate-title").textContent = minutes === 1 ? "Decisions per minute by verdict"
      : "Decisions per " + minutes + " minutes by verdict";
    const t = s.totals;
    $("stats-summary").textContent = s.count + " decisions in the window: " +
      VERDICTS.map((v) => t[v] + " " + v).join(", ") + ".";
    $("stats-truncated").textContent = s.truncated
      ? "Counted in full from " + s.complete_from + " only: the newest " + s.scanned + " records of the window were read (bound)."
      : "";
    const buckets = s.buckets;
    const peak = Math.max(1, ...buckets.map((b) => VERDICTS.reduce((n, v) => n + b[v], 0)));
    const W = 10;  // one bucket's width in SVG units; bars leave a gap of 2
    const H = 100;
    const chart = svg("svg", {
      id: "rate-svg", viewBox: "0 0 " + (buckets.length * W) + " " + H, preserveAspectRatio: "none",
      role: "img", "aria-label": $("stats-summary").textContent,
    });
    buckets.forEach((b, i) => {
      let y = H;
      for (const v of VERDICTS) {
        if (!b[v]) continue;
        const h = (b[v] / peak) * (H - 4);
        y -= h;
        chart.appendChild(svg("rect", {
          class: "bar bar-" + v, x: i * W + 1, y: y, width: W - 2, height: h,
          dataset: { verdict: v, start: b.start, count: b[v] },
        }, svg("title", {}, hhmm(b.start) + " " + v + ": " + b[v])));
      }
    });
    chart.appendChild(svg("line", { class: "baseline", x1: 0, y1: H - 0.5, x2: buckets.length * W, y2: H - 0.5 }));
    $("rate-chart").replaceChildren(chart);
    $("rate-from").textContent = buckets.length ? hhmm(buckets[0].start) : "";
    $("rate-max").textContent = "peak " + peak + " per bar";
    $("rate-to").textContent = hhmm(s.until);
  }

  function drawTop(list, empty, items, key) {
    const most = Math.max(1, ...items.map((it) => it.count));
    list.replaceChildren(...items.map((it) => el("li", { dataset: { name: it[key], count: it.count } },
      el("span", { className: "name" }, it[key]), el("span", { className: "count" }, it.count),
      svg("svg", { viewBox: "0 0 100 4", preserveAspectRatio: "none", "aria-hidden": "true" },
        svg("rect", { class: "top-track", x: 0, y: 0, width: 100, height: 4 }),
        svg("rect", { class: "top-bar", x: 0, y: 0, width: (it.count / most) * 100, height: 4,
          dataset: { count: it.count } }, svg("title", {}, it[key] + ": " + it.count))))));
    empty.hidden = items.length !== 0;
  }

  // -- one record --------------------------------------------------------------------------------
  function marks(d) {
    const extra = d.extra || {};
    const flow = extra.dataflow || {};
    const out = [];
    if (extra.replayed) out.push(["replayed", "replayed" + (extra.replayed_from ? " from " + extra.replayed_from : "")]);
    if (extra.shadow) out.push(["shadow", "shadow: not enforced, recorded only"]);
    if (flow.flagged && flow.mode === "shadow") out.push(["shadow", "data flow flagged in shadow mode (forwarded)"]);
    if (extra.in_band) out.push(["in-band", "approved in band by the user"]);
    return out;
  }

  async function loadDetail(id) {
    let d;
    try { d = await api("/v1/decisions/" + encodeURIComponent(id)); }
    catch (err) { handle("decisions-error")(err); return; }
    openedId = id;
    for (const row of $("decisions-body").children) row.classList.toggle("selected", row.dataset.decisionId === id);
    const extra = d.extra || {};
    const lat = d.latency_ms || {};
    const flow = extra.dataflow || {};
    $("detail-id").textContent = d.decision_id;
    $("detail-marks").replaceChildren(...marks(d).map(([kind, text]) =>
      el("span", { className: "mark-" + kind, dataset: { mark: kind } }, text)));
    const pairs = [
      ["time", d.ts], ["verdict", d.verdict], ["code", d.code], ["check", d.check], ["rule", d.rule],
      ["reason", d.reason], ["revision", d.revision], ["principal", d.principal], ["session", d.session],
      ["run", d.run], ["tool", show(d.upstream) + "." + show(d.tool)], ["args digest", d.args_digest],
      ["latency ms", "envelope " + show(lat.envelope) + ", upstream " + show(lat.upstream) + ", total " + show(lat.total)],
      ["upstream status", d.upstream_status], ["approval", extra.approval_id], ["grant", extra.grant_id],
      ["approver", extra.approver],
      ["replayed", extra.replayed ? "yes" + (extra.replayed_from ? ", from " + extra.replayed_from : "") : "no"],
      ["shadow", extra.shadow ? "yes" : "no"],
    ];
    if (d.method) pairs.splice(10, 0, ["method", d.method]);
    if (extra.idempotency_key) pairs.push(["idempotency key", extra.idempotency_key]);
    const traceId = d.trace_id || extra.trace_id;
    if (traceId) pairs.push(["trace id", traceId]);
    if (flow.flagged) pairs.push(["data flow", flow.rule + " (" + show(flow.mode) + (flow.on_flag ? ", on_flag " + flow.on_flag : "") + ")"]);
    fields($("detail-fields"), pairs);
    const outcome = flow.mode === "shadow" ? "flagged (shadow)" : (flow.on_flag === "approve" ? "sent to approval" : "flagged");
    const rows = evidenceRows(flow.evidence, outcome).concat(evidenceRows(extra.dataflow_declassified, "declassified"));
    $("detail-evidence-body").replaceChildren(...rows);
    $("detail-evidence").hidden = rows.length === 0;
    $("detail-evidence-none").hidden = rows.length !== 0;
    $("detail-args").textContent = "args" in d ? json(d.args) : "not recorded (the tool's policy has log_args off): digest only";
    $("detail-raw").textContent = json(d);
    $("decision-detail").hidden = false;
    $("detail-title").focus();
  }

  function closeDetail() {
    if ($("decision-detail").hidden) return;
    $("decision-detail").hidden = true;
    const row = openedId === null ? null
      : Array.from($("decisions-body").children).find((r) => r.dataset.decisionId === openedId);
    openedId = null;
    for (const r of $("decisions-body").children) r.classList.remove("selected");
    // Back to the row it was opened from; if the list changed meanwhile, to its first row.
    const target = row || $("decisions-body").querySelector("tr.decision-row");
    if (target) target.focus();
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
    openedId = null;
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
    $("f-window").addEventListener("change", loadDecisions);
    $("detail-close").addEventListener("click", closeDetail);
    document.addEventListener("keydown", (e) => {
      if (e.key === "Escape" && !$("decision-detail").hidden) { e.preventDefault(); closeDetail(); }
    });
    $("shadow-filters").addEventListener("submit", (e) => { e.preventDefault(); loadShadow(); });
    if (token()) signIn();
  });
})();
