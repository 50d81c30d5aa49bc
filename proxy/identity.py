"""Runtime identity: who is calling, from static config or a verified JWT.

Not a check: the front resolves the principal before building a `ToolCall`. Client-supplied
identity headers (X-Principal and the like) are never trusted; static mode ignores every header.
In jwt mode the accepted algorithms are pinned by config (never "none", never chosen by the
token) and the key is typed at startup, so an HS256 token "signed" with an RSA public key is
refused. PyJWT and cryptography are imported only in jwt mode, when `Identity` is built.

Principal and group ids, from every source (a token's claims, the static identity, approvers'
names in the config), are names a person reads and compares: in audit records, on the review
page, in the self-approval rule. `name_problem` refuses those that do not read as what they are:
characters not shown or that reorder text, whitespace at an edge, empty, over 256 characters. A
token naming such a principal or group is refused (401), as any token the proxy cannot take.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from proxy.approvals.reveal import visible
from proxy.envelope.invisible import invisible_class
from proxy.envelope.types import Principal
from proxy.errors import ConfigError, IdentityError

Algorithm = Literal["HS256", "RS256", "ES256"]


# The longest principal or group id, in characters: every audit record and store key holds the
# principal (as `MAX_RUN_ID_CHARS` bounds a run id).
MAX_NAME_CHARS = 256
# Unicode categories no principal or group id holds, with what a refusal calls them: a reader
# does not see them, sees them as a line break, or (surrogates, private use, unassigned) cannot
# know what they are. The other invisible characters are `proxy.envelope.invisible`'s.
_REFUSED_CATEGORIES = {
    "Cc": "a control character", "Cf": "a format character: zero-width, bidi or other invisible",
    "Zl": "a line separator", "Zp": "a paragraph separator", "Cs": "a surrogate",
    "Co": "a private-use character", "Cn": "an unassigned code point",
}
# How much of a refused id a message shows (escaped: never the raw characters).
_SHOWN_CHARS = 64


def name_problem(value: str) -> str | None:
    """What is wrong with `value` as a principal or group id, naming the character (as U+XXXX,
    never itself) and its position; None when it is one. An id is 1 to `MAX_NAME_CHARS`
    characters, none of the `_REFUSED_CATEGORIES` nor invisible (`proxy.envelope.invisible`),
    with no whitespace at either end. Never raises."""
    if not value:
        return "it is empty"
    if len(value) > MAX_NAME_CHARS:
        return f"it has {len(value)} characters (at most {MAX_NAME_CHARS})"
    if not (value.isascii() and value.isprintable()):  # printable ASCII: nothing to look up
        invisible = invisible_class()
        for at, char in enumerate(value):
            category = unicodedata.category(char)
            what = _REFUSED_CATEGORIES.get(category)
            if what is None and invisible.match(char):
                what = "an invisible character"
            if what is not None:
                return f"it holds U+{ord(char):04X} ({what}) at position {at}"
    if value != value.strip():
        return "it has whitespace at its start or end"
    return None


def shown_name(value: str) -> str:
    """`value` quoted for a message: cut to its first characters, every control, hidden or
    text-reordering character written as an escape (`proxy.approvals.reveal.visible`)."""
    cut = value[:_SHOWN_CHARS]
    return f"'{visible(cut)}'" + (f" (first {_SHOWN_CHARS} of {len(value)} characters)"
                                  if len(value) > _SHOWN_CHARS else "")


def names_problem(what: str, names: Iterable[str]) -> str | None:
    """The first of `names` (principal or group ids) that is not one, said as `<what> <the name,
    escaped> is not a usable id: <problem>`; None when all are."""
    for name in names:
        problem = name_problem(name)
        if problem is not None:
            return f"{what} {shown_name(name)} is not a usable id: {problem}"
    return None


# The most clock skew `identity.leeway` may tolerate: five minutes (Kerberos' classic bound).
MAX_LEEWAY = 300.0


class IdentityConfig(BaseModel):
    """How callers are identified. Absent: static mode, principal "agent" with no groups."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["static", "jwt"] = "static"
    # static: every call is this principal.
    principal: str = "agent"
    groups: list[str] = Field(default_factory=list)
    # jwt: the accepted signing algorithms (one family: HS256 alone, or RS256/ES256).
    algorithms: list[Algorithm] = Field(default_factory=list)
    # jwt: the HS256 secret or the PEM public key; exactly one of key / key_file.
    key: str | None = None
    key_file: Path | None = None
    # jwt: required `aud` / `iss` values. Absent: not checked.
    audience: str | None = None
    issuer: str | None = None
    # Seconds of clock skew tolerated for exp / nbf / iat (0 to MAX_LEEWAY).
    leeway: float = 30
    # Tokens must carry `exp`. Absent: true (a token without expiry is refused).
    require_exp: bool = True
    principal_claim: str = "sub"
    groups_claim: str = "groups"

    @model_validator(mode="after")
    def _jwt_fields(self) -> IdentityConfig:
        if self.mode != "jwt":
            problem = (names_problem("identity.principal", [self.principal])
                       or names_problem("a group of identity.groups", self.groups))
            if problem is not None:
                raise ValueError(problem)
            return self
        if (self.key is None) == (self.key_file is None):
            raise ValueError("identity mode jwt needs exactly one of 'key' or 'key_file'")
        if not self.algorithms:
            raise ValueError("identity mode jwt needs at least one algorithm")
        if "HS256" in self.algorithms and len(set(self.algorithms)) > 1:
            raise ValueError("HS256 cannot be combined with RS256/ES256: one key serves one family")
        if not 0 <= self.leeway <= MAX_LEEWAY:
            # Past it, a token is taken that long after it expired (or before it is valid):
            # a clock that far off is a broken clock, not skew.
            raise ValueError(f"leeway must be 0 to {MAX_LEEWAY:g} seconds (the clock skew tolerated "
                             f"for exp, nbf and iat), not {self.leeway:g}")
        return self


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        value = headers.get(name.title())
    return value


def _jwt_library() -> ModuleType:
    """PyJWT, imported when jwt mode is configured (static mode never loads it or cryptography).

    Raises `ConfigError` when it cannot be imported: a jwt config then fails at start-up."""
    try:
        import jwt
    except ImportError as exc:
        raise ConfigError(f"identity mode jwt needs PyJWT[crypto]: {exc}") from exc
    return jwt


class Identity:
    """Resolves the caller's `Principal` from request headers.

    `headers` is a case-insensitive mapping (aiohttp's CIMultiDict) or a dict with lower-case
    names ("Authorization" is also tried). Raises `ConfigError` at construction when the key cannot
    be read or does not fit the algorithms.
    """

    def __init__(self, config: IdentityConfig):
        self.config = config
        self._static = Principal(
            id=config.principal, groups=tuple(config.groups), claims={}, source="static"
        )
        self._key: Any = None
        self._jwt: Any = None
        if config.mode == "jwt":
            self._jwt = _jwt_library()
            self._key = self._load_key(config)
            # Built now (~40 ms, once a process) rather than by the first token naming a
            # principal or group past printable ASCII (`name_problem`).
            invisible_class()
        self._algorithms = list(config.algorithms)
        self._options: dict[str, Any] = {
            "require": ["exp"] if config.require_exp else [],
            "verify_aud": config.audience is not None,
            "verify_iss": config.issuer is not None,
        }

    @staticmethod
    def _load_key(config: IdentityConfig) -> Any:
        if config.key_file is not None:
            try:
                raw = config.key_file.read_text()
            except OSError as exc:
                raise ConfigError(f"identity key_file {config.key_file}: {exc}") from exc
        else:
            raw = config.key or ""
        if config.algorithms == ["HS256"]:
            if "-----BEGIN" in raw:
                raise ConfigError("identity key for HS256 must be a shared secret, not a PEM key")
            if len(raw.encode()) < 32:
                raise ConfigError("identity HS256 secret must be at least 32 bytes")
            return raw.encode()
        try:
            from cryptography.hazmat.primitives.asymmetric import ec, rsa
            from cryptography.hazmat.primitives.serialization import load_pem_public_key
        except ImportError as exc:
            raise ConfigError(f"identity keys RS256/ES256 need cryptography: {exc}") from exc
        try:
            key = load_pem_public_key(raw.encode())
        except ValueError as exc:
            raise ConfigError(f"identity key is not a PEM public key: {exc}") from exc
        wants = {"RS256": rsa.RSAPublicKey, "ES256": ec.EllipticCurvePublicKey}
        for alg in config.algorithms:
            if not isinstance(key, wants[alg]):
                raise ConfigError(f"identity key type does not fit algorithm {alg}")
        return key

    def resolve(self, headers: Mapping[str, str]) -> Principal:
        """The verified caller. Static mode: the configured principal, headers ignored.

        Raises `IdentityError` naming why a JWT is refused (missing, malformed, bad signature,
        algorithm not allowed, expired, not yet valid, wrong audience or issuer, no principal, a
        principal or group that is not a usable id: `name_problem`).
        """
        if self.config.mode == "static":
            return self._static
        jwt = self._jwt
        token = self._bearer(headers)
        try:
            alg = jwt.get_unverified_header(token).get("alg")
        except jwt.PyJWTError as exc:
            raise IdentityError(f"malformed bearer token: {exc}") from exc
        if alg not in self._algorithms:
            raise IdentityError(
                f"token algorithm {alg!r} is not allowed (allowed: {', '.join(self._algorithms)})"
            )
        cfg = self.config
        try:
            claims = jwt.decode(
                token,
                self._key,
                algorithms=self._algorithms,
                audience=cfg.audience,
                issuer=cfg.issuer,
                leeway=cfg.leeway,
                options=self._options,
            )
        except jwt.ExpiredSignatureError as exc:
            raise IdentityError("token expired (exp)") from exc
        except jwt.ImmatureSignatureError as exc:
            raise IdentityError(f"token not yet valid: {exc}") from exc
        except jwt.InvalidAudienceError as exc:
            raise IdentityError(f"token audience is not {cfg.audience!r}: {exc}") from exc
        except jwt.InvalidIssuerError as exc:
            raise IdentityError(f"token issuer is not {cfg.issuer!r}: {exc}") from exc
        except jwt.InvalidSignatureError as exc:
            raise IdentityError("token signature is invalid") from exc
        except jwt.MissingRequiredClaimError as exc:
            raise IdentityError(f"token is missing a required claim: {exc}") from exc
        except jwt.InvalidAlgorithmError as exc:
            raise IdentityError(f"token algorithm is not allowed: {exc}") from exc
        except jwt.PyJWTError as exc:
            raise IdentityError(f"invalid bearer token: {exc}") from exc
        subject = claims.get(cfg.principal_claim)
        if not isinstance(subject, str) or not subject:
            raise IdentityError(f"token has no principal claim {cfg.principal_claim!r}")
        raw_groups = claims.get(cfg.groups_claim)
        groups: tuple[str, ...] = ()
        if isinstance(raw_groups, list) and all(isinstance(g, str) for g in raw_groups):
            groups = tuple(raw_groups)
        elif raw_groups is not None:
            # Read as no groups, a group the token names would escape every rule that forbids
            # it (`"contractors" in principal.groups`): a token that says its groups in
            # another shape (one string, a space-separated string, objects) is refused.
            raise IdentityError(f"token's groups claim {cfg.groups_claim!r} is not a list of strings "
                                f"(a {type(raw_groups).__name__})")
        # A principal `alice\u200b` (or `alice `) reads as alice and is another name: to the
        # self-approval rule, to the audit log's readers, to policy rules naming alice.
        problem = (names_problem(f"token's principal claim {cfg.principal_claim!r}:", [subject])
                   or names_problem(f"a group in the token's groups claim {cfg.groups_claim!r}:", groups))
        if problem is not None:
            raise IdentityError(problem)
        return Principal(id=subject, groups=groups, claims=claims, source="jwt")

    @staticmethod
    def _bearer(headers: Mapping[str, str]) -> str:
        getall = getattr(headers, "getall", None)
        if getall is not None and len(getall("authorization", ())) > 1:
            # The proxy would verify one and a `forward_authorization` upstream may act on the
            # other: a request read two ways is refused, as for two Host headers.
            raise IdentityError("more than one Authorization header")
        value = _header(headers, "authorization")
        if not value:
            raise IdentityError("missing bearer token (Authorization header)")
        scheme, _, token = value.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise IdentityError("Authorization header is not a bearer token")
        return token
