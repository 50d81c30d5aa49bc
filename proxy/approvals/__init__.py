"""Approvals: a person's decision bound to one exact tool call, and grants that pre-approve a
narrow family of later calls.

An approval is bound to the call's principal, run, upstream, tool and argument digest
(`CallBinding`): approving one call never approves another. Its life:

    pending --approve--> approved --consume (cas, once)--> consumed
       |                    |
       +--deny--> denied    +-- past expires_at --> expired (pending too)

State lives in the `Store` (namespaces `approval`: id -> record, `approval_arguments`: id ->
arguments over 8 KiB, stored apart so the record stays small, `approval_by_call`: binding key ->
id, `grant`: id -> grant; hashes `approval_pending`: the pending ids, `grant_index`: the grants a
call can match, by principal, upstream, tool and run), so every replica sees every decision;
transitions are compare-and-set on the record's bytes. The store's own expiry only garbage-collects: records
stay listed for `approvals.retention` after they expire, and "expired" is computed from
`expires_at`, so it needs no writer.

`ApprovalNotifier` is process-local: it wakes calls waiting in this process when this process
decides (others poll the store), and POSTs a webhook for every new approval in a tracked
background task, retried with exponential backoff.

Every method that touches the store raises `proxy.errors.StoreError` when the store cannot
answer: callers fail closed.
"""
