"""Upstream URLs as the proxy shows them: in the admin API, in refusal reasons, audit records
and logs. Operators put credentials in URLs (`https://user:pass@host/mcp`, `?api_key=...`); a
URL leaves the process only through `strip_credentials`.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "REDACTED"
# Query parameter names whose values are credentials (case-insensitive, anywhere in the name:
# `api_key`, `access_token`, `X-Amz-Signature` (sig), `client_secret`, `passwd`...).
_SECRET_PARAM = re.compile(r"token|key|secret|passw|pwd|auth|sig|credential", re.IGNORECASE)


def strip_credentials(url: str | None) -> str | None:
    """`url` without userinfo and with credential-named query values replaced by `REDACTED`;
    a URL that cannot be parsed is shown as `REDACTED` whole (it may hold anything)."""
    if url is None:
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return REDACTED
    netloc = parts.hostname or ""
    if ":" in netloc:
        netloc = f"[{netloc}]"
    if port is not None:
        netloc = f"{netloc}:{port}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, REDACTED if _SECRET_PARAM.search(k) else v) for k, v in pairs],
                          safe=REDACTED)
    # The fragment is never sent to the upstream; it can only hold what should not be shown.
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def scrub(text: str, url: str) -> str:
    """`text` (an error message about a request to `url`) with `url`'s credentials removed
    wherever they appear: the whole URL, its userinfo and its credential query values. Library
    exceptions quote the URL they failed on; their text reaches refusal reasons and logs."""
    text = text.replace(url, strip_credentials(url) or REDACTED)
    try:
        parts = urlsplit(url)
    except ValueError:
        return text
    secrets = [v for k, v in parse_qsl(parts.query, keep_blank_values=True)
               if _SECRET_PARAM.search(k) and len(v) >= 4]
    userinfo, at, _ = parts.netloc.rpartition("@")
    if at and userinfo:
        secrets.append(userinfo)
        secrets.extend(p for p in userinfo.split(":") if len(p) >= 4)
    for secret in sorted(set(secrets), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text
