"""Checking a benchmark's output files before the run, so that minutes or hours of replays are
not lost to a typo in ``--out`` when the run ends.

A benchmark writes its JSON document (and some a Markdown table or a JSON-lines record) only
once every run has finished.  :func:`out_file_error` says, before anything runs, why such a
file could not be written: the path names a folder, its folder does not exist (unless the
benchmark creates folders, ``make_folders``), or the folder or the file is not writable.  The
``python -m simulations.bench_*`` commands turn the message into a usage error (exit status 2).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["out_file_error"]


def out_file_error(option: str, path: str | None, make_folders: bool = False) -> str | None:
    """Why ``path`` (given as ``option``) could not be written at the end of the run, or
    ``None`` (also for no path)."""
    if not path:
        return None
    target = Path(path)
    if target.is_dir():
        return f"{option} {path}: is a folder; name a file in it"
    folder = target.parent
    if make_folders:  # the benchmark creates the missing folders: the nearest existing one counts
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
    if not folder.is_dir():
        return f"{option} {path}: folder {folder} does not exist; create it or name another file"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{option} {path}: folder {folder} is not writable; name a file elsewhere"
    if target.exists() and not os.access(target, os.W_OK):
        return f"{option} {path}: the file is not writable; name another file"
    return None
