"""Identity: static principal and verified JWTs (HS256, RS256, ES256) with every refusal."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from pydantic import ValidationError

from proxy.errors import ConfigError, IdentityError
from proxy.identity import Identity, IdentityConfig, name_problem

SECRET = "s" * 40
NOW = int(time.time())  # for parametrize only: tests that depend on the clock use time.time()


def pem_public(key: Any) -> str:
    raw: bytes = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return raw.decode()


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def ec_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def claims(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "sub": "alice",
        "groups": ["admins", "dev"],
        "tenant": "t1",
        "exp": int(time.time()) + 600,
        "aud": "envelope",
        "iss": "https://issuer.example",
    }
    base.update(kw)
    return {k: v for k, v in base.items() if v is not None}


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def hs_identity(**kw: Any) -> Identity:
    cfg: dict[str, Any] = {
        "mode": "jwt",
        "algorithms": ["HS256"],
        "key": SECRET,
        "audience": "envelope",
        "issuer": "https://issuer.example",
        "leeway": 0,
    }
    cfg.update(kw)
    return Identity(IdentityConfig(**cfg))


def test_static_ignores_headers() -> None:
    ident = Identity(IdentityConfig(principal="svc", groups=["g"]))
    p = ident.resolve({"x-principal": "root", "authorization": "Bearer whatever"})
    assert p.id == "svc" and p.groups == ("g",) and p.source == "static"
    assert dict(p.claims) == {}
    assert Identity(IdentityConfig()).resolve({}).id == "agent"


def test_hs256_valid() -> None:
    p = hs_identity().resolve(bearer(jwt.encode(claims(), SECRET, algorithm="HS256")))
    assert p.id == "alice" and p.groups == ("admins", "dev") and p.source == "jwt"
    assert p.claims["tenant"] == "t1"
    assert p.as_cel()["claims"]["tenant"] == "t1"


def test_header_name_case() -> None:
    token = jwt.encode(claims(), SECRET, algorithm="HS256")
    assert hs_identity().resolve({"Authorization": f"bearer {token}"}).id == "alice"


def test_rs256_valid_from_key_file(rsa_key: rsa.RSAPrivateKey, tmp_path: Path) -> None:
    key_file = tmp_path / "pub.pem"
    key_file.write_text(pem_public(rsa_key))
    ident = Identity(
        IdentityConfig(mode="jwt", algorithms=["RS256"], key_file=key_file, audience="envelope")
    )
    token = jwt.encode(claims(), rsa_key, algorithm="RS256")
    assert ident.resolve(bearer(token)).id == "alice"


def test_es256_valid(ec_key: ec.EllipticCurvePrivateKey) -> None:
    ident = Identity(IdentityConfig(mode="jwt", algorithms=["ES256"], key=pem_public(ec_key)))
    token = jwt.encode(claims(groups=["ops", "oncall"]), ec_key, algorithm="ES256")
    p = ident.resolve(bearer(token))
    assert p.id == "alice" and p.groups == ("ops", "oncall")


@pytest.mark.parametrize("groups", ["contractors", "ops contractors", [{"name": "contractors"}], ["a", 1], {"a": 1}])
def test_a_groups_claim_of_another_shape_is_refused_not_read_as_no_groups(groups: Any) -> None:
    # Read as no groups, a token naming `contractors` would escape a rule forbidding them.
    token = jwt.encode(claims(groups=groups), SECRET, algorithm="HS256")
    with pytest.raises(IdentityError, match="groups claim 'groups' is not a list of strings"):
        hs_identity().resolve(bearer(token))


def test_no_groups_claim_is_no_groups() -> None:
    body = claims()
    body.pop("groups", None)
    assert hs_identity().resolve(bearer(jwt.encode(body, SECRET, algorithm="HS256"))).groups == ()


@pytest.mark.parametrize(
    ("token_claims", "message"),
    [
        ({"exp": NOW - 3600}, "token expired (exp)"),
        ({"nbf": NOW + 3600}, "token not yet valid"),
        ({"aud": "someone-else"}, "token audience is not 'envelope'"),
        ({"aud": None}, "token is missing a required claim"),
        ({"iss": "https://evil.example"}, "token issuer is not 'https://issuer.example'"),
        ({"sub": None}, "token has no principal claim 'sub'"),
        ({"sub": 42}, "Subject must be a string"),  # PyJWT checks sub's type
        ({"exp": None}, "token is missing a required claim"),
    ],
)
def test_hs256_refusals(token_claims: dict[str, Any], message: str) -> None:
    token = jwt.encode(claims(**token_claims), SECRET, algorithm="HS256")
    with pytest.raises(IdentityError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hs_identity().resolve(bearer(token))


def test_leeway_tolerates_small_skew() -> None:
    token = jwt.encode(claims(exp=int(time.time()) - 5), SECRET, algorithm="HS256")
    assert hs_identity(leeway=30).resolve(bearer(token)).id == "alice"


@pytest.mark.parametrize("leeway", [-1, 301, 86400])
def test_a_leeway_past_five_minutes_is_a_configuration_error(leeway: float) -> None:
    # A day of "skew" would take a token a day after it expired.
    with pytest.raises(ValueError, match=r"leeway must be 0 to 300 seconds"):
        hs_identity(leeway=leeway)
    token = jwt.encode(claims(exp=int(time.time()) - 299), SECRET, algorithm="HS256")
    assert hs_identity(leeway=300).resolve(bearer(token)).id == "alice"


def test_bad_signature() -> None:
    token = jwt.encode(claims(), "x" * 40, algorithm="HS256")
    with pytest.raises(IdentityError, match="token signature is invalid"):
        hs_identity().resolve(bearer(token))


def test_missing_or_malformed_header() -> None:
    with pytest.raises(IdentityError, match="missing bearer token"):
        hs_identity().resolve({"x-principal": "root"})
    with pytest.raises(IdentityError, match="not a bearer token"):
        hs_identity().resolve({"authorization": "Basic abc"})
    with pytest.raises(IdentityError, match="malformed bearer token"):
        hs_identity().resolve(bearer("not.a.jwt"))


def _b64(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def test_alg_none_refused() -> None:
    token = f"{_b64({'alg': 'none', 'typ': 'JWT'})}.{_b64(claims())}."
    with pytest.raises(IdentityError, match="algorithm 'none' is not allowed"):
        hs_identity().resolve(bearer(token))


def test_alg_confusion_refused(rsa_key: rsa.RSAPrivateKey) -> None:
    public = pem_public(rsa_key)
    ident = Identity(IdentityConfig(mode="jwt", algorithms=["RS256"], key=public))
    # An attacker signs an HS256 token with the (public) PEM as the HMAC secret.
    import hashlib
    import hmac

    signing_input = f"{_b64({'alg': 'HS256', 'typ': 'JWT'})}.{_b64(claims())}"
    sig = hmac.new(public.encode(), signing_input.encode(), hashlib.sha256).digest()
    token = f"{signing_input}.{base64.urlsafe_b64encode(sig).rstrip(b'=').decode()}"
    with pytest.raises(IdentityError, match="algorithm 'HS256' is not allowed"):
        ident.resolve(bearer(token))


def test_rs256_token_refused_by_hs_config(rsa_key: rsa.RSAPrivateKey) -> None:
    token = jwt.encode(claims(), rsa_key, algorithm="RS256")
    with pytest.raises(IdentityError, match="algorithm 'RS256' is not allowed"):
        hs_identity().resolve(bearer(token))


def test_es256_token_with_wrong_key(
    ec_key: ec.EllipticCurvePrivateKey,
) -> None:
    other = ec.generate_private_key(ec.SECP256R1())
    ident = Identity(IdentityConfig(mode="jwt", algorithms=["ES256"], key=pem_public(other)))
    with pytest.raises(IdentityError, match="signature is invalid"):
        ident.resolve(bearer(jwt.encode(claims(), ec_key, algorithm="ES256")))


@pytest.mark.parametrize(
    "cfg",
    [
        {"mode": "jwt", "algorithms": ["HS256"]},  # no key
        {"mode": "jwt", "algorithms": ["HS256"], "key": SECRET, "key_file": "/x"},  # both
        {"mode": "jwt", "algorithms": [], "key": SECRET},  # no algorithm
        {"mode": "jwt", "algorithms": ["none"], "key": SECRET},
        {"mode": "jwt", "algorithms": ["HS256", "RS256"], "key": SECRET},  # mixed families
        {"mode": "static", "bogus": 1},
    ],
)
def test_config_validation(cfg: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        IdentityConfig(**cfg)


def test_config_key_checks(rsa_key: rsa.RSAPrivateKey, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a PEM public key"):
        Identity(IdentityConfig(mode="jwt", algorithms=["RS256"], key="garbage"))
    with pytest.raises(ConfigError, match="does not fit algorithm ES256"):
        Identity(IdentityConfig(mode="jwt", algorithms=["ES256"], key=pem_public(rsa_key)))
    with pytest.raises(ConfigError, match="must be a shared secret"):
        Identity(IdentityConfig(mode="jwt", algorithms=["HS256"], key=pem_public(rsa_key)))
    with pytest.raises(ConfigError, match="at least 32 bytes"):
        Identity(IdentityConfig(mode="jwt", algorithms=["HS256"], key="short"))
    with pytest.raises(ConfigError, match="key_file"):
        Identity(
            IdentityConfig(mode="jwt", algorithms=["RS256"], key_file=tmp_path / "missing.pem")
        )


def test_config_is_frozen() -> None:
    cfg = IdentityConfig()
    with pytest.raises(ValidationError):
        cfg.principal = "x"


# -- principal and group ids ------------------------------------------------------------------

# Names that read as another (or as nothing), each with what `name_problem` says of it.
BAD_NAMES = [
    ("alice\u200b", "U+200B (a format character"),  # zero-width space
    ("\u202eecila", "U+202E (a format character"),  # right-to-left override
    ("ali\u2066ce", "U+2066 (a format character"),  # left-to-right isolate
    ("al\x00ice", "U+0000 (a control character"),
    ("ali\tce", "U+0009 (a control character"),
    ("ali\u2028ce", "U+2028 (a line separator"),
    ("ali\u2029ce", "U+2029 (a paragraph separator"),
    ("ali\ud800ce", "U+D800 (a surrogate"),
    ("ali\ue000ce", "U+E000 (a private-use character"),
    ("ali\U000e0041ce", "U+E0041 (a format character"),  # a tag character
    ("ali\u0378ce", "U+0378 (an unassigned code point"),
    ("ali\u034fce", "U+034F (an invisible character"),  # combining grapheme joiner
    ("ali\ufe0fce", "U+FE0F (an invisible character"),  # variation selector
    ("alice ", "whitespace at its start or end"),
    (" alice", "whitespace at its start or end"),
    ("alice\u3000", "whitespace at its start or end"),  # ideographic space
    ("", "it is empty"),
    ("a" * 257, "it has 257 characters (at most 256)"),
]


@pytest.mark.parametrize(("name", "problem"), BAD_NAMES, ids=[repr(n[:12]) for n, _ in BAD_NAMES])
def test_name_problem_says_what_is_wrong(name: str, problem: str) -> None:
    said = name_problem(name)
    assert said is not None and problem in said
    assert said.isascii() and said.isprintable()  # the character is named, never written


@pytest.mark.parametrize("name", ["alice", "Alice Smith", "alice@example.com", "José", "Мария",
                                  "山田", "svc:billing/agent-1", "a" * 256])
def test_name_problem_takes_names_people_write(name: str) -> None:
    assert name_problem(name) is None


def test_name_problem_names_where_the_character_is() -> None:
    assert name_problem("alice\u200b") == ("it holds U+200B (a format character: zero-width, "
                                          "bidi or other invisible) at position 5")


@pytest.mark.parametrize(("name", "problem"), [(n, p) for n, p in BAD_NAMES if n],
                         ids=[repr(n[:12]) for n, _ in BAD_NAMES if n])
def test_a_token_whose_principal_is_not_an_id_is_refused(name: str, problem: str) -> None:
    token = jwt.encode(claims(sub=name), SECRET, algorithm="HS256")
    with pytest.raises(IdentityError) as refused:
        hs_identity().resolve(bearer(token))
    said = str(refused.value)
    assert said.startswith("token's principal claim 'sub': '") and problem in said
    assert said.isascii() and said.isprintable()  # escaped: no raw bad character in a 401
    assert len(said) < 400  # a huge claim is not echoed whole


def test_the_principal_claim_configured_is_the_one_held_to_the_rule() -> None:
    token = jwt.encode(claims(preferred_username="Alice\u200b"), SECRET, algorithm="HS256")
    with pytest.raises(IdentityError, match=r"principal claim 'preferred_username': 'Alice\\u200b'"):
        hs_identity(principal_claim="preferred_username").resolve(bearer(token))


@pytest.mark.parametrize("group", ["admins\u200b", " admins", "a\u202edmins", "g" * 300, ""])
def test_a_token_with_a_group_that_is_not_an_id_is_refused(group: str) -> None:
    token = jwt.encode(claims(groups=["dev", group]), SECRET, algorithm="HS256")
    with pytest.raises(IdentityError, match="a group in the token's groups claim 'groups'"):
        hs_identity().resolve(bearer(token))


@pytest.mark.parametrize("cfg", [{"principal": "svc\u200b"}, {"principal": "svc "},
                                 {"principal": ""}, {"groups": ["ok", "ops\u202e"]}])
def test_a_static_identity_that_is_not_an_id_is_a_configuration_error(cfg: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="is not a usable id"):
        IdentityConfig(**cfg)
