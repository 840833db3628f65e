"""The served API against SPEC: what a client sends wrong is named, and the OpenAPI document
says what the server really answers (routes, statuses, headers, media types).

Everything runs against the shared real deployment (``herald``: nats-server, a gateway, a
worker), with the tenants' keys and the operator's admin key.
"""

from __future__ import annotations

from typing import Any

import httpx

from tests.harness import ADMIN_KEY, TLS, Deployment


def _admin(base: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10, verify=TLS)


def _fields(answer: httpx.Response) -> dict[str, str]:
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    problem = answer.json()
    assert problem["type"] == "/problems/invalid-request", problem
    return {error["field"]: error["message"] for error in problem["errors"]}


def test_every_bad_field_inside_an_admin_body_is_named_by_its_path(herald: Deployment) -> None:
    """SPEC §3/§12: an invalid body names each bad field, the same on every route. A tenant's
    `limits` is an object of fields: each bad one is named (`limits.rate_limit`), all at once,
    unknown ones included, and beside the bad fields outside it."""
    with _admin(herald.url()) as http:
        created = http.post("/admin/tenants", json={
            "id": 5, "limits": {"rate_limit": "fast", "max_running": -1, "max_streams": 1.5, "burst": 3}})
        assert set(_fields(created)) == {"id", "limits.rate_limit", "limits.max_running", "limits.max_streams",
                                         "limits.burst"}
        assert _fields(created)["limits.burst"] == "unknown field"
        huge = http.post("/admin/tenants", content=b'{"id": "huge", "limits": {"max_endpoints": 1e400}}',
                         headers={"Content-Type": "application/json"})
        assert _fields(huge) == {"limits.max_endpoints": "number out of range"}
        assert http.get("/admin/tenants/huge").status_code == 404, "nothing was made"

        assert http.post("/admin/tenants", json={"id": "contract"}).status_code == 201
        patched = http.patch("/admin/tenants/contract", json={"disabled": "yes", "limits": {"max_endpoints": "²"}})
        assert set(_fields(patched)) == {"disabled", "limits.max_endpoints"}
        # Not an object at all: the field itself is named, as before.
        assert set(_fields(http.patch("/admin/tenants/contract", json={"limits": [1]}))) == {"limits"}
        # A list's item is named by the list, its index leading the message.
        scopes = _fields(http.post("/admin/tenants/contract/keys", json={"name": "k", "scopes": ["jobs:read", "root"]}))
        assert list(scopes) == ["scopes"] and scopes["scopes"].startswith("[1]: ")
        assert http.get("/admin/tenants/contract").json()["limits"]["max_endpoints"] == 100, "nothing changed"


def _spec(herald: Deployment) -> dict[str, Any]:
    return httpx.get(herald.url() + "/schema/openapi.json", timeout=10).json()  # type: ignore[no-any-return]
