"""AdmissionReview v1 edge cases of the gating webhook, served by the real kopf operator.

Each review is POSTed over TLS as the API server would (helpers of
``tests/test_partitioner_webhook.py``).  What must hold:

* only a pod CREATE is ever patched: kopf's ``operations=["CREATE"]`` only feeds its *managed*
  webhook configuration (off here), it does not filter the requests it serves; gates can only
  be added at creation, so a gate added on UPDATE would make the API server refuse the update,
  and on the partitioner's own release (an UPDATE removing the gate) it would put the gate back;
* a pod whose slice requests are all zero asks for no slice (``partitioner.quantities``) and is
  not gated, though the name-based ``matchConditions`` send it to the webhook (those cases are
  in ``tests/test_partitioner_webhook.py``'s ``CASES``);
* the answer echoes the uid, is ``allowed``, carries a base64 ``JSONPatch`` that appends the
  gate (other gates kept) and is computed for dry-run requests too.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from fake_apiserver import ApiServer, admission_review, declare
from test_partitioner_webhook import (
    MWC_PATH,
    ca_bundle,
    configuration,
    free_port,
    operator,
    patched,
    pod,
    post_review,
    settings,
    wait_served,
)

from partitioner import gating


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


GATE = {"name": gating.GATE}


@pytest.mark.looptime
async def test_only_a_create_is_patched(kmock: ApiServer, tmp_path: Path) -> None:
    declare(kmock)
    await kmock.post(MWC_PATH, json=configuration())
    port = free_port()
    async with operator(kmock, settings(tmp_path, port)):
        ca = await wait_served(port, lambda: ca_bundle(kmock))
        # The partitioner's release: the gate removed by an UPDATE (old object gated).
        released = pod("released")
        review = admission_review(released, operation="UPDATE")
        review["request"]["oldObject"] = {
            **released,
            "spec": {**released["spec"], "schedulingGates": [GATE]},
        }
        review["request"]["options"] = {"apiVersion": "meta.k8s.io/v1", "kind": "UpdateOptions"}
        response = await post_review(port, ca, review)
        assert patched(released, response) is None, response
        assert "status" not in response
        # The same pod at CREATE is gated.
        response = await post_review(port, ca, admission_review(released))
        after = patched(released, response)
        assert after is not None and after["spec"]["schedulingGates"] == [GATE]


@pytest.mark.looptime
async def test_dry_run_gets_the_same_patch(kmock: ApiServer, tmp_path: Path) -> None:
    declare(kmock)
    await kmock.post(MWC_PATH, json=configuration())
    port = free_port()
    async with operator(kmock, settings(tmp_path, port)):
        ca = await wait_served(port, lambda: ca_bundle(kmock))
        body = pod("dry", schedulingGates=[{"name": "kueue.x-k8s.io/admission"}])
        review = admission_review(body)
        review["request"]["dryRun"] = True
        response = await post_review(port, ca, review)
        assert response["patchType"] == "JSONPatch"
        ops = json.loads(base64.b64decode(response["patch"]))
        assert ops == [{"op": "add", "path": "/spec/schedulingGates/1", "value": GATE}]
