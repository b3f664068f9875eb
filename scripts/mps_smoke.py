"""Check of the agent's real MPS path on a machine with an NVIDIA GPU (no cluster, no kubelet).

What it runs, all through the agent's own code:

* :class:`node_agent.mps.MpsControlSupervisor` starts the real ``nvidia-cuda-mps-control -d``
  for GPU 0 with the daemon-side limits the reconciler gives a GPU (those of its largest
  slice), checks it is running, re-sends changed limits to a running server, is replaced by a
  second supervisor that adopts the running daemon (an agent restart), and stops it.
* :func:`node_agent.devices.advertised_devices` and :func:`~node_agent.devices.container_env`
  give the environment ``Allocate`` returns for two MPS slices of that GPU; a CUDA client
  (PyTorch) runs with exactly that environment (plus ``CUDA_VISIBLE_DEVICES``, which the
  container runtime derives from ``NVIDIA_VISIBLE_DEVICES``).  It must allocate within its
  slice's memory and fail beyond it; a client that dropped its limit variables must still be
  capped by the daemon at the largest slice; the same client *without* MPS must be able to
  allocate beyond the limit (so the check can fail).
* While a client runs, NVML's process lists (the adapter's, and the MPS variant) are read.

Nothing in the GPU's settings is changed: the compute mode stays as found (MPS runs in
``DEFAULT`` as well as ``EXCLUSIVE_PROCESS``; the agent sets the latter on its nodes, which a
lent machine must not), no MIG call, no reset.  Every daemon started is quit at the end.

Usage: ``python scripts/mps_smoke.py`` prints one JSON document; exit 0 when every check
holds, 1 when one fails, 2 when MPS or a GPU is not available there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contract.nodepartitioning import ActualGpu, ActualMpsSlice
from node_agent.devices import (
    ENV_VISIBLE,
    advertised_devices,
    container_env,
    mps_pipe_directory,
    mps_slice_id,
)
from node_agent.mps import CONTROL, MpsControlSupervisor, MpsDaemonSpec, MpsError
from node_agent.nvml import NvmlError
from node_agent.nvml_pynvml import PynvmlAdapter
from node_agent.runner import subprocess_runner

MiB = 2**20
CLIENT = r"""
import json, sys, time, torch
ok, over, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
out = {"sms": torch.cuda.get_device_properties(0).multi_processor_count}
x = torch.empty(ok * 2**20, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
out["ok_alloc"] = True
try:
    y = torch.empty(over * 2**20, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
    out["over_alloc"] = True
    del y
except torch.OutOfMemoryError as e:
    out["over_alloc"] = False
    out["over_error"] = str(e).splitlines()[0][:160]
out["kernel"] = torch.ones(4096, device="cuda").sum().item() == 4096
print(json.dumps(out), flush=True)
time.sleep(hold)
"""

SLICES = ((8192, 25), (16384, 50))
"""The two MPS slices of GPU 0 (MiB, active-thread %)."""


def client(env: dict[str, str], ok_mib: int, over_mib: int, hold_s: float = 0.0) -> Any:
    """Start a CUDA client with ``env`` added; returns (process, first JSON line or error)."""
    p = subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(ok_mib), str(over_mib), str(hold_s)],
        env={**_base_env(), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    try:
        return p, json.loads(line)
    except json.JSONDecodeError:
        p.wait(60)
        err = (p.stderr.read() if p.stderr else "")[-600:]
        return p, {"error": (line + err).strip()}


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("CUDA_MPS_"):
            del env[k]
    return env


def mps_processes(gpu_handle: Any) -> list[dict[str, Any]]:
    import pynvml

    try:
        procs = pynvml.nvmlDeviceGetMPSComputeRunningProcesses(gpu_handle)
    except pynvml.NVMLError as e:
        return [{"error": str(e)}]
    return [{"pid": int(p.pid), "used_mib": (p.usedGpuMemory or 0) // MiB} for p in procs]


def main() -> int:
    doc: dict[str, Any] = {"checks": {}}
    checks: dict[str, bool] = doc["checks"]
    if shutil.which(CONTROL) is None:
        print(json.dumps({"error": f"{CONTROL} not on PATH"}))
        return 2
    try:
        ad = PynvmlAdapter()
        gpu = ad.gpus()[0]
    except (NvmlError, IndexError) as e:
        print(json.dumps({"error": f"NVML: {e}"}))
        return 2
    doc["gpu"] = {
        "name": gpu.name,
        "uuid": gpu.uuid,
        "memory_mib": gpu.memory_mib,
        "compute_mode": gpu.compute_mode.name,
        "mig_enabled": gpu.mig_enabled,
    }
    if gpu.mig_enabled:
        print(json.dumps({**doc, "error": "GPU 0 is in MIG mode; this check needs it off"}))
        return 2
    root = tempfile.mkdtemp(prefix="gpuslice-mps-")
    slices = [
        ActualMpsSlice(
            memoryMiB=m, activeThreadPercentage=t, deviceId=mps_slice_id(gpu.uuid, k, m, t)
        )
        for k, (m, t) in enumerate(SLICES)
    ]
    actual = ActualGpu(index=0, uuid=gpu.uuid, model=gpu.name, mps=slices)
    devices = [d for ds in advertised_devices([actual], mps_pipe_root=root).values() for d in ds]
    envs = {d.id: container_env([d]) for d in devices}
    doc["allocate_env"] = envs
    largest = max(m for m, _ in SLICES)
    spec = MpsDaemonSpec(
        key="gpu0",
        device_uuid=gpu.uuid,
        pipe_dir=mps_pipe_directory(root, 0),
        log_dir=f"{root}/log/gpu0",
        default_thread_percentage=max(t for _, t in SLICES),
        default_pinned_mem_limit_mib=largest,
    )
    import pynvml

    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    sup = MpsControlSupervisor()
    started: list[MpsDaemonSpec] = []
    try:
        # 0. control: the same client without MPS goes past the slice's memory
        _, ctl = client({"CUDA_VISIBLE_DEVICES": gpu.uuid}, 4096, 8192)
        doc["client_without_mps"] = ctl
        checks["without MPS the client can allocate past 8 GiB"] = ctl.get("over_alloc") is True
        full_sms = ctl.get("sms")

        # 1. the daemon
        t0 = time.monotonic()
        sup.ensure(spec)
        started.append(spec)
        doc["daemon_start_s"] = round(time.monotonic() - t0, 3)
        checks["daemon running after ensure"] = "gpu0" in sup.running()
        sup.ensure(spec)  # idempotent: no second daemon
        checks["second ensure keeps one daemon"] = sup.running() == {"gpu0"}

        # 2. each slice's client, with the env Allocate returns
        for (mem, pct), d in zip(SLICES, sorted(devices, key=lambda x: x.id), strict=True):
            env = dict(envs[d.id])
            env["CUDA_VISIBLE_DEVICES"] = env[ENV_VISIBLE]
            p, out = client(env, mem - 2048, 4096, hold_s=6.0)
            doc[f"client_{mem}m_{pct}p"] = out
            checks[f"{mem} MiB slice: allocation within the slice works"] = (
                out.get("ok_alloc") is True and out.get("kernel") is True
            )
            checks[f"{mem} MiB slice: allocation past the slice fails"] = (
                out.get("over_alloc") is False
            )
            if isinstance(full_sms, int) and isinstance(out.get("sms"), int):
                checks[f"{pct} % slice: the client sees fewer SMs"] = out["sms"] < full_sms
            servers = sup._servers(spec) or []
            doc[f"servers_{mem}m"] = servers
            checks[f"{mem} MiB slice: get_server_list names the server"] = bool(servers)
            pids = ad.running_processes(0)
            doc[f"nvml_processes_{mem}m"] = [{"pid": q, "name": ad.process_name(q)} for q in pids]
            doc[f"nvml_mps_processes_{mem}m"] = mps_processes(handle)
            checks[f"{mem} MiB slice: the adapter sees a process on the GPU"] = bool(pids)
            if mem == largest:  # 3. new limits reach the running server
                lowered = replace(spec, default_thread_percentage=40)
                try:
                    sup.ensure(lowered)
                    checks["changed limits sent to the running server"] = True
                    spec = lowered
                except MpsError as e:
                    doc["limit_update_error"] = str(e)
                    checks["changed limits sent to the running server"] = False
            p.terminate()
            p.wait(30)

        # 4. a client that dropped its limit variables is capped by the daemon (largest slice)
        env = {"CUDA_VISIBLE_DEVICES": gpu.uuid, "CUDA_MPS_PIPE_DIRECTORY": spec.pipe_dir}
        p, out = client(env, largest - 2048, 4096)
        doc["client_without_limits"] = out
        checks["client without limit env: capped at the largest slice"] = (
            out.get("ok_alloc") is True and out.get("over_alloc") is False
        )
        p.wait(30)

        # a reading, not a check: what stays on the GPU once every client has ended
        time.sleep(3)
        servers = sup._servers(spec) or []
        idle: dict[str, Any] = {"servers": servers}
        idle["nvml_processes"] = [
            {"pid": q, "name": ad.process_name(q)} for q in ad.running_processes(0)
        ]
        idle["nvml_mps_processes"] = mps_processes(handle)
        for pid in servers:
            rc, txt = subprocess_runner(
                [CONTROL], {"CUDA_MPS_PIPE_DIRECTORY": spec.pipe_dir}, f"get_client_list {pid}\n"
            )
            idle[f"clients_of_{pid}"] = [rc, txt.strip()]
        doc["after_last_client"] = idle

        # 5. agent restart: a new supervisor adopts the running daemon
        sup2 = MpsControlSupervisor()
        sup2.discover([spec])
        checks["a new supervisor adopts the running daemon"] = sup2.running() == {"gpu0"}
        sup2.ensure(spec)  # re-sends the limits, starts nothing
        checks["adopted daemon takes the limits again"] = sup2.running() == {"gpu0"}

        # 6. stop
        sup2.stop("gpu0")
        time.sleep(1)
        checks["stop quits the daemon"] = not sup._alive(spec)
        started.clear()
    except (MpsError, OSError) as e:
        doc["error"] = f"{type(e).__name__}: {e}"
        checks["no error"] = False
    finally:
        for s in started:  # never leave a daemon behind
            subprocess.run(
                [CONTROL],
                input="quit\n",
                text=True,
                capture_output=True,
                env={**_base_env(), "CUDA_MPS_PIPE_DIRECTORY": s.pipe_dir},
            )
        log = Path(root, "log", "gpu0", "control.log")
        if log.exists():
            doc["control_log_tail"] = log.read_text(errors="replace").splitlines()[-12:]
    doc["ok"] = all(checks.values())
    print(json.dumps(doc, indent=1))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
