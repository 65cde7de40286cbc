"""L3: a bounded directory of KV blocks on local disk, kept across restarts.

One file a block, named by its key. Files are written to a temporary name and
renamed, so a crash leaves either the whole block or nothing under its name;
temporaries left by a crash are removed at start. At start the directory is
indexed (oldest modification first), so a restarted worker finds what it wrote
before. The byte bound is kept by removing the least recently used files.

A write that fails (the file system is full, read-only or gone) is declined:
counted in the tier's errors, logged once and then at most once a minute with
a count (a full disk fails every block), and the tier reports itself unhealthy
until a write succeeds again. Reads go on meanwhile.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
import uuid
from collections import OrderedDict

from pdserve.kvstore.tier import KVTier

log = logging.getLogger("pdserve.kvstore")

SUFFIX = ".kvblock"
LOCK_WAIT_S = 15.0  # how long a new tier waits for the directory's previous user to let go
_KEY = re.compile(r"^[0-9a-f]{1,64}-[0-9a-f]{1,64}$")  # model fingerprint - block hash: no path tricks


class DiskTier(KVTier):
    name = "disk"
    persistent = True

    def __init__(self, directory: str, capacity_bytes: int, log_interval_s: float = 60.0):
        super().__init__()
        if capacity_bytes <= 0:
            raise ValueError("the disk tier needs a positive --kv-disk-bytes")
        self.directory = os.path.abspath(directory)
        self.capacity_bytes = capacity_bytes
        self._lock_fd = _own_directory(self.directory)
        self._files: OrderedDict[str, int] = OrderedDict()  # key -> size, least recently used first
        self._writing: dict[str, int] = {}  # key -> size of blocks being written (not readable yet)
        self.used_bytes = 0  # both of the above
        self.log_interval_s = log_interval_s
        self._write_failing = False  # the last write failed
        self._failed = 0  # writes failed since writes last succeeded
        self._failed_unlogged = 0  # of those, not yet in a log message
        self._failure_logged_at = float("-inf")
        self._index()

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key + SUFFIX)

    def _index(self) -> None:
        found = []
        with os.scandir(self.directory) as it:
            for e in it:
                if e.name.endswith(".tmp"):
                    _unlink(e.path)  # a write a crash interrupted
                elif (
                    e.name.endswith(SUFFIX)
                    and _KEY.match(e.name[: -len(SUFFIX)])
                    and e.is_file(follow_symlinks=False)  # a link could lead anywhere: never read
                ):
                    st = e.stat(follow_symlinks=False)
                    found.append((st.st_mtime, e.name[: -len(SUFFIX)], st.st_size))
        for _, key, size in sorted(found):
            self._files[key] = size
            self.used_bytes += size
        self._shrink(0)
        if found:
            log.info(
                "disk KV tier %s: %d blocks (%.1f MB) from before",
                self.directory,
                len(self._files),
                self.used_bytes / 1e6,
            )

    def _shrink(self, room: int) -> None:
        while self._files and self.used_bytes + room > self.capacity_bytes:
            key, size = self._files.popitem(last=False)
            self.used_bytes -= size
            self.stats.evictions += 1
            _unlink(self._path(key))

    def contains(self, key: str) -> bool:
        with self.lock:
            return key in self._files

    def touch(self, key: str) -> bool:
        with self.lock:
            if key not in self._files:
                return False
            self._files.move_to_end(key)
            return True

    def healthy(self) -> bool:
        """False while writes fail: blocks are not being kept."""
        with self.lock:
            return not self._write_failing

    def get(self, key: str) -> bytes | None:
        with self.lock:
            size = self._files.get(key)
            if size is None:
                return None
            self._files.move_to_end(key)
        try:
            data = _read_regular(self._path(key), size)
        except OSError as e:
            log.warning("disk KV tier: cannot read %s: %s", key, e)
            self.forget(key, error=True)
            return None
        with self.lock:
            self.stats.bytes_out += len(data)
        return data

    def forget(self, key: str, error: bool = False) -> None:
        """Drop a block (it proved corrupt or unreadable)."""
        with self.lock:  # the unlink too: a put of the same key may rename its new file in after
            size = self._files.pop(key, None)
            if size is not None:
                self.used_bytes -= size
                if error:  # (not when a concurrent write evicted it meanwhile)
                    self.stats.errors += 1
                _unlink(self._path(key))

    def put(self, key: str, data: bytes) -> bool:
        if not _KEY.match(key) or len(data) > self.capacity_bytes:
            with self.lock:
                self.stats.errors += 1
            return False
        with self.lock:
            if key in self._files:
                self._files.move_to_end(key)
                return True
            if key in self._writing:
                return True
            self._shrink(len(data))
            # counted before the write, so concurrent puts cannot overshoot the bound together; indexed
            # (readable) only once the file is in place under its name
            self._writing[key] = len(data)
            self.used_bytes += len(data)
        tmp = os.path.join(self.directory, f".{uuid.uuid4().hex}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))
        except OSError as e:  # the disk is full or gone: a cache declines, it does not fail
            _unlink(tmp)
            with self.lock:
                self._writing.pop(key, None)
                self.used_bytes -= len(data)
                self.stats.errors += 1
                self._write_failed(e)
            return False
        with self.lock:
            self._writing.pop(key, None)
            self._files[key] = len(data)
            self.stats.bytes_in += len(data)
            self.stats.stores += 1
            if self._write_failing:
                log.info(
                    "disk KV tier %s: writes succeed again (%d blocks were not written meanwhile)",
                    self.directory,
                    self._failed,
                )
                self._write_failing, self._failed, self._failed_unlogged = False, 0, 0
        return True

    def _write_failed(self, e: OSError) -> None:
        """Under the lock. Logs the first failure and then at most once per `log_interval_s`:
        a full disk fails every block, and one line a block would flood the log."""
        self._failed += 1
        self._failed_unlogged += 1
        now = time.monotonic()
        if not self._write_failing:
            log.warning(
                "disk KV tier %s: cannot write blocks: %s; not keeping blocks on disk until a write succeeds "
                "(kv_tier_healthy 0; failures counted in kv_tier_errors, logged at most every %.0f s)",
                self.directory,
                e,
                self.log_interval_s,
            )
        elif now - self._failure_logged_at >= self.log_interval_s:
            log.warning(
                "disk KV tier %s: still cannot write blocks: %s (%d more not written)",
                self.directory,
                e,
                self._failed_unlogged,
            )
        else:
            return
        self._write_failing, self._failure_logged_at, self._failed_unlogged = True, now, 0

    def close(self) -> None:
        """Let go of the directory (its files stay, for the next worker that takes it)."""
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            os.close(fd)  # releases the lock

    def __len__(self) -> int:
        return len(self._files)


def _own_directory(directory: str) -> int:
    """Make the tier's directory, or take an existing one, as this user's alone (mode 0700; one
    another user owns is refused: they could plant blocks), and hold its lock file for the life
    of the process, so that two workers never share one directory (each would delete the
    other's writes in progress at start and evict the other's blocks). Returns the lock's fd."""
    import fcntl

    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.stat(directory)
    if st.st_uid != os.geteuid():
        raise ValueError(f"the disk KV tier directory {directory} belongs to another user (uid {st.st_uid})")
    if st.st_mode & 0o077:
        os.chmod(directory, 0o700)  # os.makedirs leaves an existing directory's mode as it was
    fd = os.open(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise ValueError(
                    f"the disk KV tier directory {directory} is in use by another process (give each worker "
                    "its own --kv-disk-dir)"
                ) from None
            time.sleep(0.2)  # a worker that is restarting over its old self, whose close writes down


def _read_regular(path: str, size: int) -> bytes:
    """The `size` bytes of the regular file at `path`, not through a symbolic link and without
    blocking on something else put there (a FIFO); OSError when it is not that file any more."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise OSError(f"{path} is no longer the {size}-byte block file written here")
        chunks, left = [], size
        while left > 0:  # one read returns at most ~2 GiB, and may return less
            more = os.read(fd, min(left, 1 << 30))
            if not more:
                break
            chunks.append(more)
            left -= len(more)
        data = b"".join(chunks)
        if len(data) != size:
            raise OSError(f"{path} changed size while it was read")
        return data
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
