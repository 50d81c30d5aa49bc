"""The names the admin listener's Host check accepts."""

from __future__ import annotations

from proxy.admin.protect import admin_hosts


def test_admin_hosts() -> None:
    assert admin_hosts("0.0.0.0", []) == {"127.0.0.1", "localhost", "::1"}
    assert admin_hosts("::", ["[fd00::5]", "Ops.Example"]) >= {"fd00::5", "ops.example"}
    assert "10.1.2.3" in admin_hosts("10.1.2.3", [])
