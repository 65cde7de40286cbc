"""Shared-memory KV cache files (`pdserve-kv-<pid>-<tag>-<layer>{k,v}`) and the sweep that
removes those of dead workers. Light on imports: the launcher, which never loads torch,
sweeps after a worker it supervised died or had to be killed."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import stat
import sys
import uuid

_NAME = re.compile(r"pdserve-kv-(\d+)-[0-9a-f]+-\d+[kv]$")


def new_kv_paths(directory: str, num_layers: int) -> list[str]:
    """Fresh names for one worker's cache files, [k0, v0, k1, v1, ...], in `directory`."""
    tag = f"pdserve-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return [os.path.join(directory, f"{tag}-{layer}{kind}") for layer in range(num_layers) for kind in "kv"]


def shm_files_digest(paths: list[str]) -> str:
    """What a KV receiver answers when asked which cache files are its own: the digest of
    their paths, in order (a sender writes only into files their receiver names)."""
    return hashlib.sha256("\n".join(paths).encode()).hexdigest()


class KVFileRefused(ValueError):
    """A path named as a peer's KV cache file that this process will not map."""


def open_peer_kv_file(path: str, directory: str, nbytes: int) -> int:
    """Open a decode worker's cache file for writing, as a prefill worker on its host does;
    returns the descriptor (map it through /proc/self/fd, then close it).

    The path arrives in a request, so it is checked before anything is written: it must be a
    pdserve cache file (by its name) directly in `directory` (this worker's --kv-shm-dir),
    already exist (nothing is created), be a regular file reached without a symbolic link,
    belong to this user, and have exactly the size its layout says (mapping never grows it).
    The checks run on the opened descriptor, so the file cannot be swapped after them."""
    if not directory:
        raise KVFileRefused("this worker has no shared-memory directory (--kv-shm-dir)")
    name = os.path.basename(path)
    if not _NAME.match(name):
        raise KVFileRefused(f"{path!r} is not a pdserve KV cache file name")
    if os.path.realpath(os.path.dirname(path) or ".") != os.path.realpath(directory):
        raise KVFileRefused(f"{path!r} is not in this worker's shared-memory directory {directory!r}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise KVFileRefused(f"cannot open {path!r}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KVFileRefused(f"{path!r} is not a regular file")
        if st.st_uid != os.geteuid():
            raise KVFileRefused(f"{path!r} belongs to another user")
        if st.st_size != nbytes:
            raise KVFileRefused(f"{path!r} holds {st.st_size} bytes; its layout says {nbytes}")
    except BaseException:
        os.close(fd)
        raise
    return fd


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


def same_worker(paths: list[str]) -> bool:
    """Whether every path is one worker's cache file, of one set (`pdserve-kv-<pid>-<tag>-`)."""
    tags = {m.group(0).rsplit("-", 1)[0] if (m := _NAME.match(os.path.basename(p))) else None for p in paths}
    return len(tags) == 1 and None not in tags


def owner_holds_connection(path: str, port: int, peer: tuple[str, int]) -> bool:
    """Whether the process a KV cache file is named after (`pdserve-kv-<pid>-...`) holds the
    connection it accepted on `port` from `peer` (our end, still open): read from /proc, that
    process's own network namespace and descriptors. So a receiver answering for files is the
    files' own process on this host, not one elsewhere that names them."""
    m = _NAME.match(os.path.basename(path))
    if not m:
        return False
    pid = m.group(1)
    want = (ipaddress.ip_address(peer[0]), peer[1])
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f, None)  # the column names
                for line in f:
                    cols = line.split()  # local "HEXIP:HEXPORT", remote, state (01 established), ..., inode
                    if len(cols) > 9 and cols[3] == "01" and _port(cols[1]) == port and _endpoint(cols[2]) == want:
                        inodes.add(cols[9])
        except (OSError, ValueError):
            continue
    if not inodes:
        return False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1], 16)


def _endpoint(endpoint: str) -> tuple:
    """/proc/net/tcp's "HEXIP:HEXPORT" (each 32-bit word of the address in host byte order)."""
    hex_ip, hex_port = endpoint.rsplit(":", 1)
    raw = bytes.fromhex(hex_ip)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(hex_port, 16)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True
