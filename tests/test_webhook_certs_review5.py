"""The self-managed webhook Secret during an uninstall (review 5, webhook5 finding 3).

The hook deletes the MutatingWebhookConfiguration; the garbage collector deletes the Secret it
owns.  A partitioner replica still running (preStop, shutdown) found the configuration gone and
wrote the Secret back from its own material, without an owner: the CA key outlived ``helm
uninstall``.  Now a missing Secret is not written back while the configuration is missing too
(the replica keeps serving what it holds); it is written back, owned, once the configuration
exists again; and a replica holding nothing yet still creates it (the partitioner may start
before the configuration exists).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from fake_apiserver import MWC_RESOURCE, ApiServer, declare, stored
from test_partitioner_webhook import (
    CONFIGURATION,
    MWC_PATH,
    NAMESPACE,
    SECRET,
    ca_bundle,
    configuration,
    keeper,
)

SECRET_PATH = f"/api/v1/namespaces/{NAMESPACE}/secrets/{SECRET}"


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


def owners(api: ApiServer) -> list[tuple[str, str]] | None:
    secret = stored(api, "v1/secrets", SECRET, NAMESPACE)
    if secret is None:
        return None
    refs = secret["metadata"].get("ownerReferences") or []
    return [(r["kind"], r["uid"]) for r in refs]


@pytest.mark.looptime
async def test_no_unowned_secret_is_written_back_while_the_configuration_is_gone(
    kmock: ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    declare(kmock)
    await kmock.post(MWC_PATH, json=configuration())
    k = keeper(kmock, tmp_path, "a")
    task = asyncio.create_task(k.run())
    try:
        await k.ready.wait()
        await asyncio.sleep(25)
        held = k.material
        uid = stored(kmock, MWC_RESOURCE, CONFIGURATION)["metadata"]["uid"]
        assert owners(kmock) == [("MutatingWebhookConfiguration", uid)]
        # uninstall: the hook deletes the configuration, the garbage collector its Secret; the
        # replica runs on (a configuration check and the 1-2-4 s missing retries fall in)
        with caplog.at_level(logging.INFO, logger="gpuslice.partitioner.webhook"):
            await kmock.delete(f"{MWC_PATH}/{CONFIGURATION}")
            await kmock.delete(SECRET_PATH)
            await asyncio.sleep(45)
        assert stored(kmock, "v1/secrets", SECRET, NAMESPACE) is None
        assert k.material == held and k.server_file.read_bytes() == held.server_pem()
        messages = [r.getMessage() for r in caplog.records]
        assert not [m for m in messages if "writing back" in m]
        withheld = [m for m in messages if "is not written back" in m]
        assert len(withheld) == 1  # said once, not every retry

        # the configuration comes back (re-install, GitOps): the Secret follows at the next
        # missing-configuration retry (at most 30 s), owned by it, with the same CA (the other
        # replicas stay trusted)
        await kmock.post(MWC_PATH, json=configuration())
        await asyncio.sleep(31)
        new_uid = stored(kmock, MWC_RESOURCE, CONFIGURATION)["metadata"]["uid"]
        assert owners(kmock) == [("MutatingWebhookConfiguration", new_uid)]
        secret = stored(kmock, "v1/secrets", SECRET, NAMESPACE)
        assert secret is not None and secret["data"] == held.secret_data()
        assert ca_bundle(kmock) == held.ca_bundle
        assert not k.secret_withheld
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await k.api.close()


async def test_a_replica_holding_nothing_still_creates_the_secret_before_the_configuration(
    kmock: ApiServer, tmp_path: Path
) -> None:
    declare(kmock)
    k = keeper(kmock, tmp_path, "a")
    try:
        material = await k.sync()  # the partitioner started before the configuration exists
        assert owners(kmock) == []
        await kmock.delete(SECRET_PATH)
        assert await k.sync() == material  # now it holds material: not written back
        assert stored(kmock, "v1/secrets", SECRET, NAMESPACE) is None
    finally:
        await k.api.close()
