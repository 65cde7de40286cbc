"""Pieces the interference scripts share: a server process that is always stopped,
the CPU others took during a run, a warm-up, and the one table."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from pdserve.ports import free_port, health_is, wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TICK = os.sysconf("SC_CLK_TCK")


def snapshot(ref: str = "HEAD", root: str = "/tmp/pdserve-interference-src") -> tuple[str, dict]:
    """A clean copy of the committed tree at `ref`, and the environment to run it with.

    The working tree is shared with other engineers whose uncommitted engine changes
    (and kernel rebuilds) would otherwise be measured; the copy's kernels build once into
    a cache of their own. `python -m pdserve.cli` run from the copy imports the copy."""
    commit = subprocess.run(
        ["git", "rev-parse", ref], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    path = os.path.join(root, commit[:12])
    if not os.path.exists(os.path.join(path, "pdserve")):
        os.makedirs(path + ".tmp", exist_ok=True)
        archive = subprocess.run(["git", "archive", commit], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", path + ".tmp"], input=archive, check=True)
        os.replace(path + ".tmp", path)
    env = dict(os.environ, PDSERVE_KERNEL_CACHE=os.path.join(path, ".kernel-cache"))
    return path, env


def build_kernels(src: str, env: dict) -> None:
    """Compile the copy's C++ kernels before anything is timed (minutes the first time)."""
    code = "from pdserve.engine import cpu_kernels as k; import sys; sys.exit(k.load() is None)"
    r = subprocess.run([sys.executable, "-c", code], cwd=src, env=env, capture_output=True, text=True)
    if r.returncode:
        print(f"   warning: kernels did not build in {src}; the engine falls back to PyTorch:\n{r.stderr[-800:]}")


def load_str() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class ServerProcess:
    """Server processes, each in its own session, answering on a free loopback port; every
    session is stopped on exit (SIGTERM, then SIGKILL), whatever happened inside the `with`.

    `cmds`: the front process first (the one answering on `{port}`), then any others
    (workers that join it); "{port}" and "{url}" in an argument are filled in."""

    def __init__(
        self,
        serve_flags: list[str],
        log_path: str,
        startup_timeout_s: float = 300.0,
        cmd: list[str] | None = None,
        env: dict | None = None,
        ready_path: str = "/v1/models",
        extra_cmds: list[list[str]] = (),
        cwd: str = REPO,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        front = cmd or [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            *serve_flags,
        ]
        fill = lambda c: [a.replace("{port}", str(self.port)).replace("{url}", self.url) for a in c]
        self.cmds = [fill(front)] + [fill(c) for c in extra_cmds]
        self.log_path, self.timeout_s, self.env, self.ready_path = log_path, startup_timeout_s, env, ready_path
        self.procs: list[subprocess.Popen] = []
        self.cwd = cwd

    @property
    def cmd(self) -> list[str]:
        """Every command, joined by ' & ' when there are several (for the record)."""
        return [a for i, c in enumerate(self.cmds) for a in ([] if i == 0 else ["&"]) + c]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def __enter__(self):
        self._log = open(self.log_path, "w")
        try:
            for c in self.cmds:
                self.procs.append(
                    subprocess.Popen(
                        c,
                        cwd=self.cwd,
                        stdout=self._log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        env=self.env,
                    )
                )
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def _wait_ready(self) -> None:
        def ready() -> bool:
            return (
                health_is(self.url)
                and httpx.get(self.url + self.ready_path, timeout=2, trust_env=False).status_code == 200
            )

        took = wait_until(
            ready, self.procs, self.timeout_s, f"{self.cmds[0][:4]}", lambda: f"see {self.log_path}", interval_s=0.5
        )
        print(f"   ready in {took:.1f} s on {self.url}", flush=True)

    def stop(self, grace_s: float = 30.0) -> None:
        for p in reversed(self.procs):  # workers first, the front (router or launcher) last
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # the launcher forwards it to its workers
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for sid in self.pids:  # anything left in a session (a child that ignored SIGTERM): kill it
            for pid in _session_pids(sid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            if p.poll() is None:
                p.wait(5)
        if not self._log.closed:
            self._log.close()


def _session_pids(sid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and int(st[3]) == sid:  # field 6 (session) after pid and comm
                out.append(int(entry))
    return out


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        st = _stat(pid)
        if st is not None:
            total += (int(st[11]) + int(st[12])) / _TICK  # utime, stime
    return total


def _busy_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / _TICK  # all but idle and iowait


class TreeCpu:
    """CPU seconds the server's processes, this client and everyone else took during a run,
    in total and per `every_s` interval (a stall that lines up with a burst of others' CPU
    is the machine's load, not the deployment's interference).

    A run in which others took a large share measured the machine's load as much as
    the deployment; the share is written next to the numbers."""

    def __init__(self, server_sids: list[int], every_s: float = 1.0):
        import threading

        self.pids = [pid for sid in server_sids for pid in _session_pids(sid)]
        self.every_s = every_s
        self.trace: list[tuple[float, float]] = []  # (s since start, others' share of the machine)
        self._stop = threading.Event()
        self.t0 = time.perf_counter()
        self.first = self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _sample(self) -> tuple[float, float, float, float]:
        return time.perf_counter(), _busy_s(), _cpu_s(self.pids), time.process_time()

    def _loop(self) -> None:
        last = self.first
        ncpu = os.cpu_count() or 1  # the machine's, not this (maybe pinned) process's
        while not self._stop.wait(self.every_s):
            now = self._sample()
            wall = now[0] - last[0]
            others = (now[1] - last[1]) - (now[2] - last[2]) - (now[3] - last[3])
            self.trace.append((round(now[0] - self.t0, 2), round(max(0.0, others) / (wall * ncpu), 3)))
            last = now

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        end = self._sample()
        wall, busy, server, me = (end[i] - self.first[i] for i in range(4))
        others = max(0.0, busy - server - me)
        ncpu = os.cpu_count() or 1  # the machine's, not this (maybe pinned) process's
        return {
            "wall_s": round(wall, 1),
            "server_cpu_s": round(server, 1),
            "client_cpu_s": round(me, 1),
            "others_cpu_s": round(others, 1),
            "others_share_of_machine": round(others / (wall * ncpu), 3),
            "others_share_trace": self.trace,
        }


def warm_up(url: str, tokens, n_tokens: int = 300) -> None:
    """One short and one medium request, so first-use costs (kernel loads, the KV bridge's
    first mapping) are not in the first measured request."""
    import numpy as np

    rng = np.random.default_rng(12345)
    with httpx.Client(base_url=url, timeout=600, trust_env=False) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        for n in (16, n_tokens):
            r = c.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": tokens.random_ids(rng, n),
                    "max_tokens": 4,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            )
            r.raise_for_status()


def itl_split_ms(res: dict, pct: float = 99) -> tuple[float | None, float | None]:
    """The chats' ITL percentile for gaps that overlap a long prompt's prefill (its send to its
    first token) and for all other gaps: the interference itself, apart from everything else."""
    import numpy as np

    st, ttft, tags = res["start_times"], res["ttfts"], res["tags"]
    windows = [(st[i], st[i] + ttft[i]) for i, t in enumerate(tags) if t == "long" and ttft[i]]
    inside, outside = [], []
    for i, tag in enumerate(tags):
        if tag != "chat" or res["errors"][i]:
            continue
        end = st[i] + ttft[i]
        for gap in res["itls"][i]:
            begin, end = end, end + gap
            hit = any(a < end and begin < b for a, b in windows)
            (inside if hit else outside).append(gap * 1000)
    f = lambda v: float(np.percentile(v, pct)) if v else None
    return f(inside), f(outside)


_COLUMNS = [  # header, source ("chat": the chats' summary; "all": every request), key, format
    ("TPOT p50", "chat", "median_tpot_ms", "{:.0f}"),
    ("TPOT p99", "chat", "p99_tpot_ms", "{:.0f}"),
    ("ITL p50", "chat", "median_itl_ms", "{:.0f}"),
    ("ITL p99", "chat", "p99_itl_ms", "{:.0f}"),
    ("p99/p50", "chat", None, "{:.1f}x"),
    ("ITL p99 in / out of a long prefill", "chat", None, None),
    ("TTFT mean", "all", "mean_ttft_ms", "{:.0f}"),
    ("TTFT p99", "all", "p99_ttft_ms", "{:.0f}"),
    ("chat TTFT p99", "chat", "p99_ttft_ms", "{:.0f}"),
    ("long TTFT mean", "long", "mean_ttft_ms", "{:.0f}"),
    ("goodput req/s", "all", "request_goodput", "{:.3f}"),
    ("SLO %", "all", "slo_attainment_pct", "{:.0f}"),
    ("done/failed", "all", None, None),
    ("others' CPU", "all", None, None),
]


def _cell(res: dict, src: str, key: str | None, fmt: str | None, header: str) -> str:
    part = res if src == "all" else res.get("by_tag", {}).get(src, {})
    if header == "p99/p50":
        a, b = part.get("p99_itl_ms"), part.get("median_itl_ms")
        return fmt.format(a / b) if a and b else "-"
    if header.startswith("ITL p99 in"):
        inside, outside = itl_split_ms(res)
        return " / ".join("-" if v is None else f"{v:.0f}" for v in (inside, outside))
    if header == "done/failed":
        return f"{res['completed']}/{res['failed']}"
    if header == "others' CPU":
        share = (res.get("cpu") or {}).get("others_share_of_machine")
        return "-" if share is None else f"{100 * share:.0f}%"
    v = part.get(key)
    return "-" if v is None else fmt.format(v)


def format_table(results: dict[str, dict], slos_ms: dict[str, float]) -> str:
    """One markdown table: a row per config, chats' TPOT/ITL (ms), TTFT (ms), goodput."""
    head = ["config"] + [c[0] for c in _COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, res in results.items():
        cells = [name] + [_cell(res, *c[1:], c[0]) for c in _COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    # the SLOs the results were scored at (a saved result keeps its own)
    slos_ms = next((r["goodput_slos_ms"] for r in results.values() if r.get("goodput_slos_ms")), slos_ms)
    slo = " ".join(f"{k}:{v:g}" for k, v in slos_ms.items())
    lines.append(
        f"\nTPOT and ITL: chat requests only (ms); TTFT: all requests unless marked; "
        f"goodput and SLO attainment at {slo} ms; others' CPU: share of the machine that "
        f"processes outside this experiment took during the run."
    )
    return "\n".join(lines)
