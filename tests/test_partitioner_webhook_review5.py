"""The webhook reads AdmissionReviews of real pod sizes (a review's finding: aiohttp's default
cap of 1 MiB answered 413 for a pod with large env values, which ``failurePolicy: Ignore`` then
admitted ungated, and nothing was logged), and logs each review it cannot answer."""

from __future__ import annotations

import json
import logging
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fake_apiserver import ApiServer, admission_review, declare
from test_partitioner_webhook import (
    HOST,
    MWC_PATH,
    WEBHOOK_PATH,
    ca_bundle,
    configuration,
    free_port,
    operator,
    pod,
    settings,
    wait_served,
)

from partitioner.webhook import MAX_REVIEW_BYTES


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


async def post(port: int, ca: bytes, body: bytes) -> tuple[int, str]:
    context = ssl.create_default_context(cadata=ca.decode())
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"https://127.0.0.1:{port}{WEBHOOK_PATH}",
            data=body,
            headers={"Content-Type": "application/json"},
            ssl=context,
            server_hostname=HOST,
        ) as resp,
    ):
        return resp.status, await resp.text()


@pytest.mark.looptime
async def test_a_large_pod_is_gated_and_an_unreadable_review_is_logged(
    kmock: ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    declare(kmock)
    await kmock.post(MWC_PATH, json=configuration())
    port = free_port()
    async with operator(kmock, settings(tmp_path, port)):
        ca = await wait_served(port, lambda: ca_bundle(kmock))
        big = pod("big")
        big["spec"]["containers"][0]["env"] = [{"name": "BIG", "value": "x" * (1400 * 1024)}]
        raw = json.dumps(admission_review(big)).encode()
        assert 1024 * 1024 < len(raw) < MAX_REVIEW_BYTES
        status, text = await post(port, ca, raw)
        assert status == 200, text[:200]
        answer = json.loads(text)["response"]
        assert answer["allowed"] is True and "patch" in answer  # gated
        with caplog.at_level(logging.WARNING, logger="gpuslice.partitioner.webhook"):
            status, _ = await post(port, ca, b"{not json")
        assert status == 400
        assert any("not JSON" in r.getMessage() for r in caplog.records)
