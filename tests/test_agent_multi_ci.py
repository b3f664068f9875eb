"""A GPU instance with several compute instances (``nvidia-smi mig -cci``, a mig-parted config
with ``1c.3g`` profiles: made outside gpuslice, which makes one CI per GI).  The agent keyed it
by its first CI's MIG UUID only: a pod holding another CI's device did not make it used (a
spec change destroyed it under the pod), and a spec keeping its placement was Applied with the
first CI (one compute slice) advertised as the whole ``mig-3g.40gb`` (node_agent.gpu_plan,
"split" instances)."""

from __future__ import annotations

from tests.test_agent_reconciler import Node, mig_spec

FIRST = "MIG-aaaaaaaa-0000-4000-8000-000000000001"
SECOND = "MIG-bbbbbbbb-0000-4000-8000-000000000002"


def split_node() -> Node:
    """An A100-80GB with a 3g.40gb at slot 4 holding two compute instances."""
    node = Node("A100-SXM4-80GB", mig=True)
    p = node.nv.model_of(0).profile("3g.40gb")
    gi = node.nv.create_gpu_instance(0, p.profile_id, 4, p.memory_slices)
    cis = node.nv._gpus[0].gis[gi].cis
    cis.clear()
    cis[0], cis[1] = FIRST, SECOND
    return node


def advertised_ids(node: Node) -> set[str]:
    return {d.id for devices in node.published for ds in devices.values() for d in ds}


def test_a_pod_holding_any_compute_instance_keeps_the_instance_and_degrades_the_gpu() -> None:
    node = split_node()
    node.pods.ids = {SECOND}
    res = node.run(mig_spec(("3g.40gb", 4)))
    (inst,) = res.status.gpus[0].mig
    assert inst.used and not res.applied
    assert res.blocks[0].reason == "InstanceInUse" and SECOND in res.blocks[0].message

    res = node.run(mig_spec(("2g.20gb", 4), ("1g.10gb", 6)), gen=2)
    assert not res.applied and res.blocks[0].reason == "InstanceInUse"
    assert {FIRST, SECOND} <= set(node.nv.mig_uuids())  # not destroyed under the pod
    assert not {FIRST, SECOND} & advertised_ids(node)  # neither CI is a whole 3g.40gb


def test_a_free_split_instance_is_replaced_by_a_whole_one() -> None:
    node = split_node()
    res = node.run(mig_spec(("3g.40gb", 4)))
    assert res.applied, res.status.conditions
    ((_gi, p, start, uuids),) = node.nv.instances(0)
    assert (p.name, start, len(uuids)) == ("3g.40gb", 4, 1)
    assert not {FIRST, SECOND} & set(uuids)
    assert [d.id for d in res.devices["nvidia.com/mig-3g.40gb"]] == list(uuids)
    assert not {FIRST, SECOND} & advertised_ids(node)
