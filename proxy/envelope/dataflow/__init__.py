"""Data flow: the run ledger of untrusted and secret content, and matching sink arguments against it.

`fingerprint` (normalising, grams, winnowing, distinctive tokens), `ledger` (the store layout,
recording and loading), `match` (which arguments can carry text, and what they copy) and
`offload` (fingerprinting large inputs in a worker thread), `intent` (the user's words the
framework sends in `X-Envelope-Intent`, and the values they endorse), `endorse` (tainted-run
escalation: the critical values of a sink and what endorses them, the keys trusted outputs
record for it) and `shape` (instruction-shaped sentences, which still flag inside declassified
arguments). The check itself is `proxy.envelope.checks.dataflow`.

Per run, a **ledger** in the store holds fingerprints of the untrusted and secret content the
run has read: hashes of normalised character grams, winnowed (of every `winnow` consecutive
grams of N - winnow + 1 characters the smallest hash is kept, so every copied run of N =
`min_match` characters shares a kept one), and hashes of distinctive tokens (e-mail addresses, URLs and domains, account-number-like digit runs, IBANs;
normalised, at least 8 characters), and, only when `min_value` is on (off by default: it
makes recording 3-4x costlier and flags benign copies), hashes of the word-bounded phrases of 1 to 4
words (6 characters up to N) of untrusted content, which a short sink argument (at least
`min_value` characters) is looked up by as a whole (finding `value`). It is two store hashes (`Store.hash_put` / `hash_get`): the
fingerprints, each pointing at its source tool, and a small one of flags (untrusted, secret,
overflowed), sources and pending markers. Checking a sink fetches the flags and asks for exactly
the fingerprints of its arguments (two round trips, cost proportional to the arguments, never to
the ledger); recording an output adds fields (flags only get set and fingerprints only get added,
so concurrent calls of a run never contend). When the cap `ledger_cap` is reached, later content
is not fingerprinted and every free-text sink argument counts as matching: eviction widens a
verdict, never narrows it. Work is bounded the same way: token scanning is linear in the text,
an output is fingerprinted up to `max_output_chars` characters (past them the run overflows),
and a sink argument longer than `max_argument_chars` is not hashed but counts as matching
(finding `coarse`) when the run holds untrusted content.

A **sink** is a call whose effect is not `read`. Its string arguments (and long integers) are
matched unless the tool's schema constrains them (enum, const, boolean, bounded number, a
`skip_formats` format, maxLength below 8). A sink is flagged when an argument contains a run of
at least N untrusted characters verbatim, or carries a distinctive untrusted token, or (the
trifecta) the run holds both untrusted and secret content. `declassify` lets listed sinks or
arguments receive untrusted text: their verbatim runs are audited as declassified flows, but a
token lifted from untrusted content in them is still flagged, and so is a copied sentence that
is instruction-shaped or a copied run of `declassify_max_copy` characters.

**Tainted-run escalation** (`on_tainted`, off by default): a sink of a run that has read
untrusted content whose critical arguments are not all endorsed (by the run's intent, or by a
trusted output of the run, which then records endorsing keys under a `trusted` source: they
never taint) goes to the approval gate or is refused, rule `dataflow.tainted_run`.

Modes: `shadow` forwards flagged calls (audited with the evidence under `dataflow`, counted in
`envelope_dataflow_flagged_total`); `enforce` refuses them with `dataflow_policy_blocked`, or,
with `on_flag: approve` for the sink and an approval gate configured, sends them to the approval
gate with the evidence (`ToolCall.escalation`). No `dataflow:` section: shadow.

Recording: everything an upstream sends toward the client (tool results, error replies, task
results, resource and prompt contents, messages relayed in a stream) is recorded by the one
inspection seam (`proxy.envelope.inspect`, run by `Envelope.complete`) before it is delivered,
with the labels of its tool, resource or prompt. When the store cannot take it, enforce withholds
it (refused `store_unavailable`), shadow delivers it and audits `dataflow_error`. A session read
answered with an SSE stream also gets a pending marker before any of the stream is relayed
(`Envelope.stream_opens`), because a client may resume a dropped stream on another replica,
which does not know the call's labels: recording the output clears it, and a marker left past
its deadline makes the run coarse (fail closed: content the agent may have seen was not
fingerprinted with its labels). A JSON answer reaches the client only through the process that
forwarded the call, which records it first: no marker. What this process recorded for a run in
the last minute is not written again (`RecentWrites`, one per process, in `Services.recent`).

Fail closed: in enforce mode a sink with no store refuses `misconfigured` and a store error
refuses `store_unavailable`; in shadow mode both are audited (`dataflow_error`) and the call
continues.
"""
