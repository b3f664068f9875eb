"""Read-only smoke test of the real NVML path on a machine with an NVIDIA GPU (no cluster).

Runs the agent's :class:`node_agent.nvml_pynvml.PynvmlAdapter` read calls against the driver --
GPU listing, MIG mode, GPU instances and MIG devices where MIG is on, running processes and
their names -- once with the GPU idle and once while a child process holds GPU memory (through
PyTorch, when it is installed), and prints one JSON document.  Nothing on the GPU is changed:
no MIG mode, compute mode, instance or reset call is made.  The catalog check is
``python -m node_agent.catalog_probe``; both are run by the device check described in
docs/operations.md ("Checking a new GPU model").

Usage: ``python scripts/nvml_smoke.py`` (exit 0 when every read succeeded and the child's PID
was seen, 1 otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node_agent.nvml import NvmlError
from node_agent.nvml_pynvml import PynvmlAdapter

HOLD = (
    "import torch, time, sys; x = torch.empty(256 * 2**20, dtype=torch.uint8, device='cuda'); "
    "torch.cuda.synchronize(); print('ready', flush=True); time.sleep(float(sys.argv[1]))"
)


def snapshot(ad: PynvmlAdapter) -> list[dict[str, Any]]:
    out = []
    for g in ad.gpus():
        entry: dict[str, Any] = {
            "index": g.index,
            "name": g.name,
            "pci_device_id": g.pci_device_id,
            "memory_mib": g.memory_mib,
            "mig_capable": g.mig_capable,
            "mig_enabled": g.mig_enabled,
            "pending_mig_enabled": g.pending_mig_enabled,
            "compute_mode": g.compute_mode.name,
            "pci_bus_id": g.pci_bus_id,
        }
        try:
            if g.mig_enabled:
                entry["gpu_instances"] = [asdict(i) for i in ad.gpu_instances(g.index)]
                entry["mig_devices"] = [asdict(d) for d in ad.mig_devices(g.index)]
            pids = ad.running_processes(g.index)
            entry["processes"] = [{"pid": p, "name": ad.process_name(p)} for p in pids]
        except NvmlError as e:
            entry["error"] = str(e)
        out.append(entry)
    return out


def main() -> int:
    ad = PynvmlAdapter()
    doc: dict[str, Any] = {"idle": snapshot(ad)}
    child = None
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", HOLD, "30"], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        ready = child.stdout.readline().strip() == "ready"
        doc["child"] = {"pid": child.pid, "ready": ready}
        if ready:
            time.sleep(1)
            doc["busy"] = snapshot(ad)
    except (OSError, AssertionError) as e:
        doc["child"] = {"error": str(e)}
    finally:
        if child is not None:
            child.kill()
            child.wait()
        ad.close()
    seen = any(
        p["pid"] == doc["child"].get("pid") for g in doc.get("busy", []) for p in g["processes"]
    )
    doc["child_pid_seen"] = seen
    doc["own_pid"] = os.getpid()
    errors = [g["error"] for g in doc["idle"] + doc.get("busy", []) if "error" in g]
    print(json.dumps(doc, indent=2, default=str))
    return 0 if seen and not errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
