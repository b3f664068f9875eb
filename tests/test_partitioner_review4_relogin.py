"""Every kopf login reads the credentials afresh (review 4, finding 1).

kopf logs in again after a 401 and refuses credentials it has just seen rejected.  The login
handler used to hand the first login's connection back for good, so once the API server stopped
accepting the token the pod started with (the kubelet rotated the projected token file, the
token was revoked, an exec plugin's token expired) kopf ran out of credentials and the operator
exited with ``LoginError``.  Now each login reads the token file again, and the partitioner's
own client (:meth:`partitioner.operator.Controller._endpoint`) sends the new token too.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp.web
import attrs
import kmock
import kopf
import pytest
from fake_apiserver import ApiServer, declare
from test_partitioner_operator import A100, create, eventually, node, pod, settings

from partitioner.operator import Controller, build_registry, run_operator


@attrs.define
class AuthServer(ApiServer):
    """The fake API server, answering 401 to a bearer token not in ``valid``."""

    valid: set[str] = attrs.field(factory=lambda: {"t1"})
    tokens: list[str] = attrs.field(factory=list)
    """Tokens of the requests that carried one, in order."""

    async def _handle(self, request: kmock.Request) -> Any:  # type: ignore[override]
        token = str(request.headers.get("Authorization", "")).removeprefix("Bearer ").strip()
        if token:  # the test's own client sends none
            self.tokens.append(token)
            if token not in self.valid:
                body = {"kind": "Status", "apiVersion": "v1", "status": "Failure"}
                body |= {"message": "Unauthorized", "reason": "Unauthorized", "code": 401}
                return aiohttp.web.json_response(body, status=401)
        return await super()._handle(request)


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": AuthServer}


@pytest.mark.looptime
async def test_a_rotated_token_is_read_again_after_a_401(
    kmock: AuthServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    declare(kmock)
    token_file = {"token": "t1"}  # what the kubelet keeps in the projected token file
    logins: list[str] = []

    def login_with_service_account(**_: Any) -> kopf.ConnectionInfo:
        logins.append(token_file["token"])
        return kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), token=token_file["token"])

    monkeypatch.setattr(kopf, "login_with_service_account", login_with_service_account)
    await create(kmock, "/api/v1/nodes", node("n1", {"gpuslice.io/partitioning": "mig", **A100}))
    clock = asyncio.get_running_loop().time
    controller = Controller(settings(), clock=clock)  # as in production: no connection given
    stop = asyncio.Event()
    task = asyncio.create_task(run_operator(controller, stop_flag=stop))
    try:
        await eventually(lambda: controller.last_cycle is not None, within=30, step=0.1)
        await create(kmock, "/api/v1/namespaces/default/pods", pod("p1", "nvidia.com/mig-1g.10gb"))
        await eventually(lambda: "default/p1" in controller.index.pods, within=10)
        token_file["token"] = "t2"  # rotated; the API server no longer accepts t1
        kmock.valid = {"t2"}
        await asyncio.sleep(5)
        await create(kmock, "/api/v1/namespaces/default/pods", pod("p2", "nvidia.com/mig-1g.10gb"))
        await asyncio.sleep(120)
        assert not task.done(), f"the operator exited: {task.exception()}"
        assert logins[:2] == ["t1", "t2"]
        assert controller.connection is not None and controller.connection.token == "t2"
        assert "default/p2" in controller.index.pods  # kopf's watches work again
        # the partitioner's own client (lists, writes, the Lease) sends the new token too
        assert controller._endpoint().headers["Authorization"] == "Bearer t2"
        assert kmock.tokens[-1] == "t2"
        first = kmock.tokens.index("t2")
        assert "t1" not in kmock.tokens[first:]
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, timeout=30)
        await controller.stop()  # kopf ran no cleanup if it exited with LoginError


def test_a_given_connection_is_the_login() -> None:
    """Tests and tools pass a connection: every login returns it, none is read from a file."""
    given = kopf.ConnectionInfo(server="https://example.invalid", token="fixed")
    controller = Controller(settings(), connection=given)
    registry = build_registry(controller)
    (handler,) = [h for h in registry._activities.get_all_handlers() if h.id == "login"]

    def refuse(**_: Any) -> None:
        raise AssertionError("a given connection is not read again")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kopf, "login_with_service_account", refuse)
        mp.setattr(kopf, "login_with_kubeconfig", refuse)
        assert handler.fn() is given
        assert handler.fn() is given
    assert controller.connection is given
