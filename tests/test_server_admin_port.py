"""With ANNEAL_ADMIN_TOKEN set, the admin API listens on --admin-port only, behind the token."""

from __future__ import annotations

import importlib.util

import httpx
import pytest

from live_server import LiveServer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("anneal.engine.admin") is None,
    reason="anneal.engine.admin (the admin API) is not in this build yet",
)
TOKEN = "test-admin-token"


@pytest.fixture(scope="module")
def server():
    s = LiveServer(env={"ANNEAL_ADMIN_TOKEN": TOKEN}).wait_ready()
    yield s
    assert s.stop() == 0


def test_admin_state_needs_the_token_and_lives_on_the_admin_port(server):
    admin = f"http://127.0.0.1:{server.admin_port}"
    r = httpx.get(admin + "/admin/state", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["plan_hash"] == server.health()["plan_hash"]
    assert httpx.get(admin + "/admin/state", timeout=30).status_code == 401
    bad = httpx.get(admin + "/admin/state", headers={"Authorization": "Bearer nope"}, timeout=30)
    assert bad.status_code == 401
    assert httpx.get(server.url + "/admin/state",
                     headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404
