"""An XID that comes in while a pass reuses its GPU instance id marks the whole GPU (review 4 #5).

Before the fix the event (here XID 48 on GI 1) was resolved at the next pass by GI id against
the *new* instance the pass had created with the same id: that new, healthy instance was
advertised Unhealthy and ``Degraded/GpuXid`` blamed it, while the instance actually hit was gone
and no whole-GPU mark was made (hunt3/agent3 ``r4_xid_gi_reuse.py``).  Now the reconciler
records the GI ids a pass destroys or creates, and an event that came in before the pass had
made its changes and names one of them marks the whole GPU (node_agent.xid, "GPU instance ids
the agent reused").  An event after the pass is still pinned to its instance.
"""

from __future__ import annotations

from node_agent.nvml import XidEvent
from node_agent.reconciler import Reconciler
from node_agent.xid import XidLedger
from tests.test_agent_reconciler import CAT, Node, mig_spec


class XidNode(Node):
    def __init__(self) -> None:
        super().__init__("A100-SXM4-80GB", mig=True)
        self.ledger = XidLedger()
        self.agent = Reconciler(
            self.nv,
            self.pods,
            self.sup,
            CAT,
            mps_pipe_root="/run/mps",
            publish=self.publish,
            xids=self.ledger,
        )

    def xid_during(self, op: str) -> list[int]:
        """The watcher queues XID 48 of the GI of the first ``op`` call (``destroy_gpu_instance``:
        the old instance) the next pass makes, while the pass runs."""
        fired: list[int] = []

        def hook(name: str, args: tuple[int, ...]) -> None:
            if name == op and not fired:
                fired.append(args[1])
                self.ledger.add(XidEvent(0, 48, gi_id=args[1], ci_id=0))

        self.nv.hooks.append(hook)
        return fired


def test_an_xid_during_a_pass_that_reuses_its_gi_id_marks_the_whole_gpu() -> None:
    node = XidNode()
    assert node.run(mig_spec(("3g.40gb", 4))).applied
    [(old_gi, _, _, (old_uuid,))] = node.nv.instances(0)
    fired = node.xid_during("destroy_gpu_instance")
    node.run(mig_spec(("4g.40gb", 0)), gen=2)
    [(new_gi, profile, start, (new_uuid,))] = node.nv.instances(0)
    assert fired == [old_gi] and new_gi == old_gi and new_uuid != old_uuid  # the id was reused
    assert (profile.name, start) == ("4g.40gb", 0)

    res = node.run(mig_spec(("4g.40gb", 0)), gen=2)
    [mark] = node.agent.xid_marks
    assert mark.device == "" and mark.gpu == 0  # the whole GPU, not the new instance by guess
    assert "GPU instance 1 was destroyed or created while the event came in" in mark.where
    msg = res.blocks[0].message
    assert res.blocks[0].reason == "GpuXid" and "XID 48" in msg and "on the whole GPU" in msg
    assert new_uuid not in msg  # the new instance is not blamed
    assert res.status.gpus[0].unhealthy  # a whole-GPU mark
    assert not any(d.healthy for ds in res.devices.values() for d in ds)


def test_an_xid_after_the_pass_on_a_new_instance_still_marks_that_instance_only() -> None:
    node = XidNode()
    assert node.run(mig_spec(("3g.40gb", 4))).applied
    node.run(mig_spec(("4g.40gb", 0), ("3g.40gb", 4)), gen=2)  # creates GI 2 at slot 0
    gi, _, _, (uuid,) = next(t for t in node.nv.instances(0) if t[2] == 0)
    node.ledger.add(XidEvent(0, 48, gi_id=gi, ci_id=0))  # after the pass made its changes
    res = node.run(mig_spec(("4g.40gb", 0), ("3g.40gb", 4)), gen=2)
    [mark] = node.agent.xid_marks
    assert mark.device == uuid and "4g.40gb at memory slot 0" in mark.where
    health = {d.id: d.healthy for ds in res.devices.values() for d in ds}
    assert health[uuid] is False and sum(health.values()) == 1  # the 3g stays Healthy


def test_an_xid_during_a_pass_on_a_gi_the_pass_did_not_touch_marks_only_that_instance() -> None:
    node = XidNode()
    assert node.run(mig_spec(("3g.40gb", 0), ("3g.40gb", 4))).applied
    kept_gi, _, _, (kept_uuid,) = next(t for t in node.nv.instances(0) if t[2] == 4)

    def hook(name: str, args: tuple[int, ...]) -> None:
        if name == "destroy_gpu_instance":
            node.ledger.add(XidEvent(0, 48, gi_id=kept_gi, ci_id=0))

    node.nv.hooks.append(hook)
    node.run(mig_spec(("2g.20gb", 0), ("3g.40gb", 4)), gen=2)  # replaces the GI at slot 0
    node.nv.hooks.remove(hook)
    node.run(mig_spec(("2g.20gb", 0), ("3g.40gb", 4)), gen=2)
    [mark] = node.agent.xid_marks
    assert mark.device == kept_uuid
