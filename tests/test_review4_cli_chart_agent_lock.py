"""One agent per node: the real agent holds a ``flock`` in its state dir (review 4, item 5).

A second agent on the same node (a surging rollout, a copy started by hand) exits 2 naming the
lock file before it registers a device plugin or touches a GPU; the device-plugin agent and the
DRA agent lock different files, so they never exclude each other.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gpuslice.cli import BadInput
from gpuslice.commands import agent as agent_cmd

ROOT = Path(__file__).resolve().parent.parent


class Settings:
    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.node_name = "gpu-7"


def test_a_second_holder_is_refused_naming_the_file(tmp_path: Path) -> None:
    state = tmp_path / "state"  # created on demand
    path = re.escape(str(state / "agent.lock"))
    with agent_cmd.one_agent_per_node(str(state), "agent.lock"):
        with (
            pytest.raises(BadInput, match=f"another gpuslice agent holds {path}") as e,
            agent_cmd.one_agent_per_node(str(state), "agent.lock"),
        ):
            pytest.fail("entered twice")
        assert "maxSurge 0" in str(e.value)
        with agent_cmd.one_agent_per_node(str(state), "dra-agent.lock"):  # the DRA agent's
            pass
    with agent_cmd.one_agent_per_node(str(state), "agent.lock"):  # released on the way out
        pass


def test_no_state_dir_and_an_unusable_one_take_no_lock(tmp_path: Path) -> None:
    with agent_cmd.one_agent_per_node("", "agent.lock"):
        pass
    blocker = tmp_path / "file"
    blocker.write_text("")
    with agent_cmd.one_agent_per_node(str(blocker / "sub"), "agent.lock"):  # not a directory
        pass


@pytest.mark.parametrize(
    ("runner", "lock"), [("_run_real", "agent.lock"), ("_run_dra", "dra-agent.lock")]
)
def test_the_real_agents_stop_before_starting_when_another_holds_the_lock(
    runner: str, lock: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[str] = []

    async def inner(*_: Any) -> int:
        started.append(runner)
        return 0

    monkeypatch.setattr(agent_cmd, runner + "_locked", inner)
    args: tuple[Any, ...] = (
        (argparse.Namespace(), Settings(str(tmp_path)), None)
        if runner == "_run_real"
        else (Settings(str(tmp_path)), None, "shaped")
    )
    fd = os.open(tmp_path / lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path = re.escape(str(tmp_path / lock))
        with pytest.raises(BadInput, match=f"another gpuslice agent holds {path}"):
            asyncio.run(getattr(agent_cmd, runner)(*args))
        assert started == []
    finally:
        os.close(fd)
    assert asyncio.run(getattr(agent_cmd, runner)(*args)) == 0
    assert started == [runner]


def test_another_process_holding_the_lock_makes_the_agent_exit_2(tmp_path: Path) -> None:
    """As on a node: the first agent is another process, the second is ``gpuslice agent``."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import fcntl, os, sys, time
                fd = os.open({str(tmp_path / "agent.lock")!r}, os.O_RDWR | os.O_CREAT)
                fcntl.flock(fd, fcntl.LOCK_EX)
                print("held", flush=True)
                time.sleep(60)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSLICE_")}
        env |= {"GPUSLICE_NODE_NAME": "gpu-7", "GPUSLICE_STATE_DIR": str(tmp_path)}
        done = subprocess.run(
            [sys.executable, "-m", "gpuslice", "agent"],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=120,
        )
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 2, done.stderr
    assert f"another gpuslice agent holds {tmp_path}/agent.lock" in done.stderr
    assert "Traceback" not in done.stderr
