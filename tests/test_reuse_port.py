"""``HERALD_HTTP_REUSE_PORT``: several gateways on one address, the kernel spreading
connections over them (SO_REUSEPORT); without it a taken port still stops a gateway."""

from __future__ import annotations

import httpx

from tests.harness import KEYS, Deployment, free_port, wait_until


def test_gateways_with_reuse_port_share_one_port_and_each_serves(fresh: Deployment) -> None:
    port = free_port()
    fresh.start_gateway("gateway", port, HERALD_HTTP_REUSE_PORT="1")
    fresh.start_gateway("gateway2", port, HERALD_HTTP_REUSE_PORT="1")
    # /readyz on the shared port may have been answered by the first: the second says so itself.
    wait_until(lambda: fresh.logged("gateway2", "gateway ready"), what="second gateway ready")
    auth = {"Authorization": f"Bearer {KEYS['acme']}"}

    def both_served() -> bool:
        # A new connection each time: the kernel picks one of the listening sockets per connection.
        response = httpx.get(f"http://127.0.0.1:{port}/jobs", headers=auth, timeout=5)
        # A gateway listens before its store is open and says so (503, Retry-After): not yet.
        assert response.status_code == 200 or (response.status_code == 503 and "retry-after" in response.headers)
        return all(fresh.logged(name, "request", route="/jobs", status=200) for name in ("gateway", "gateway2"))

    wait_until(both_served, timeout=30, what="requests answered by both gateways")


def test_without_reuse_port_a_taken_port_stops_the_gateway(fresh: Deployment) -> None:
    port = free_port()
    fresh.start_gateway("gateway", port, HERALD_HTTP_REUSE_PORT="1")
    second = fresh._spawn("gateway2", ["gateway"], fresh.env(HERALD_HTTP_PORT=str(port)))
    assert second.wait(timeout=60) != 0, "the default bind is exclusive"
    assert "address already in use" in (fresh.logs / "gateway2.log").read_text().lower()
