"""Shared-memory KV cache files (`pdserve-kv-<pid>-<tag>-<layer>{k,v}`) and the sweep that
removes those of dead workers. Light on imports: the launcher, which never loads torch,
sweeps after a worker it supervised died or had to be killed."""

from __future__ import annotations

import os
import re

_NAME = re.compile(r"pdserve-kv-(\d+)-[0-9a-f]+-\d+[kv]$")


def sweep_stale_kv_files(directory: str) -> list[str]:
    """Remove KV cache files left by dead workers (`pdserve-kv-<pid>-...`).

    atexit cannot run for a worker that was killed (SIGKILL, OOM, a crash), and
    /dev/shm is RAM: without this sweep every such death leaks a whole KV cache."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if not m or _pid_alive(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True
