"""`openapi:` on an upstream: the spec is loaded with the revision, relative to the policy file's
directory (or fetched from a URL), and a spec that cannot be used is a policy problem with a
place."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from proxy.errors import PolicyError
from proxy.policy.loader import load_policy

Write = Callable[[str, str], Path]
BILLING = Path(__file__).resolve().parents[2] / "fixtures" / "openapi" / "billing.yaml"


def test_the_spec_is_loaded_relative_to_the_policy_files_directory(write: Write) -> None:
    policy = write("team/billing.yaml", """
        version: 1
        upstreams:
          billing: {url: "http://127.0.0.1:9/api", openapi: specs/billing.yaml}
          mail: {url: "http://127.0.0.1:9/mcp"}
        tools:
          billing.deleteInvoice: {effect: write}
    """)
    (policy.parent / "specs").mkdir()
    shutil.copy(BILLING, policy.parent / "specs" / "billing.yaml")
    revision = load_policy(policy.parents[1])
    assert list(revision.specs) == ["billing"]
    spec = revision.specs["billing"]
    assert spec.source == str(policy.parent / "specs" / "billing.yaml")
    assert "getInvoice" in spec.operations
    assert revision.document.upstreams["billing"].openapi == "specs/billing.yaml"


def test_a_missing_spec_is_a_problem_at_the_openapi_key(write: Write) -> None:
    policy = write("p.yaml", """
        version: 1
        upstreams:
          billing:
            url: "http://127.0.0.1:9/api"
            openapi: nope.yaml
    """)
    with pytest.raises(PolicyError) as err:
        load_policy(policy.parent)
    [problem] = err.value.problems
    assert (problem.file, problem.line, problem.column) == (str(policy), 5, 14)
    assert "upstream 'billing': cannot read the OpenAPI document" in problem.message


def test_an_unusable_spec_is_a_problem_at_its_own_place(write: Write) -> None:
    policy = write("p.yaml", """
        version: 1
        upstreams:
          billing: {url: "http://127.0.0.1:9/api", openapi: spec.yaml}
    """)
    (policy.parent / "spec.yaml").write_text("# a spec\nopenapi: 2.0.0\npaths: {}\n")
    with pytest.raises(PolicyError) as err:
        load_policy(policy.parent)
    [problem] = err.value.problems
    assert (problem.file, problem.line, problem.column) == (str(policy.parent / "spec.yaml"), 2, 10)
    assert problem.message.startswith("OpenAPI document of upstream 'billing': not an OpenAPI 3.0 or 3.1")
    assert str(problem).startswith(f"{policy.parent / 'spec.yaml'}:2:10: ")


@pytest.fixture
def spec_server() -> Iterator[str]:
    body = BILLING.read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/openapi.yaml":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_spec_url_is_fetched_at_load(write: Write, spec_server: str) -> None:
    policy = write("p.yaml", f"""
        version: 1
        upstreams:
          billing: {{url: "{spec_server}", openapi: "{spec_server}/openapi.yaml"}}
          other: {{url: "{spec_server}", openapi: "{spec_server}/missing.yaml"}}
    """)
    with pytest.raises(PolicyError) as err:
        load_policy(policy.parent)
    [problem] = err.value.problems
    assert (problem.file, problem.line) == (str(policy), 4)
    assert "upstream 'other': cannot fetch the OpenAPI document" in problem.message
    policy.write_text(policy.read_text().replace("  other:", "# other:"))
    revision = load_policy(policy.parent)
    assert revision.specs["billing"].source == f"{spec_server}/openapi.yaml"
