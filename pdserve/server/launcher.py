"""`pdserve serve` in disaggregated mode: a router plus N prefill and M decode workers on this host.

Each part is the same process an operator would start by hand (`pdserve
router`, `pdserve worker`); this launcher starts them, spreads the workers over
the cores, and supervises. Clients connect to the launcher itself: its front
(front.py) forwards every request to the router on a loopback port and resumes
the streams of a router that dies, so a router crash costs a pause, not answers.

- each child gets its settings as a config file (`pdserve worker --config FILE`,
  JSON, 0600 in a private directory removed when the deployment stops): every
  setting it shares with serve, by the same definition (pdserve/settings.py), so
  none can be left out;
- a fresh cluster secret per deployment (unless one is given), handed to the
  children in their environment, never on a command line or in a file;
- a child that exits is restarted with exponential backoff (reset once it has
  run for a minute); the restart count reaches the router's /metrics;

- SIGTERM / SIGINT drains: the front and the router first (new requests get
  503, those in flight finish, up to --shutdown-timeout), then the workers, so
  no stream loses its worker before its router is done with it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from pdserve import auth, flags
from pdserve.control_api import PoolPollRequest, PoolPollResponse
from pdserve.kv.shm_files import sweep_stale_kv_files
from pdserve.ports import die_with_parent
from pdserve.server.front import Front
from pdserve.settings import COMMANDS

log = logging.getLogger("pdserve.launcher")

BACKOFF_FIRST_S, BACKOFF_MAX_S, STABLE_S = 0.5, 30.0, 60.0
# A router that answered since it (re)started and then answers nothing for this long is hung
# (stopped, deadlocked, its loop blocked): it is killed, so that it restarts and the front
# resumes its streams, rather than every request waiting on it forever.
ROUTER_HUNG_S = 20.0
RESTARTS_ENV = "PDSERVE_RESTARTS"  # in each worker's environment: how often it was restarted (it tells the router)
LOOPBACK = "127.0.0.1"
USAGE_ERROR = 2  # what a pdserve command exits with for bad flags or config: restarting cannot help


class ConfigError(RuntimeError):
    """A child refused its configuration."""


def child_settings(args, command: str, **overrides) -> dict:
    """A child's config file (`pdserve <command> --config FILE`): every setting that serve
    and the child both have, with serve's value, then what differs per child (by dest).
    Nothing is listed by hand, so no flag can be left behind; secrets stay out (they
    travel in the environment)."""
    return flags.document(COMMANDS[command], {**vars(args), **overrides})


def router_settings(args, host: str, port: int, public: bool = True) -> dict:
    """The router listens on host:port; the rest is the deployment's. `public`: clients reach
    it at the deployment's address (on Ray), so the names given with --internal-aliases are its;
    behind the front they are the front's (which signs again for the router)."""
    return child_settings(args, "router", host=host, port=port, **({} if public else {"internal_aliases": None}))


def worker_settings(
    args, role: str, index: int, router_url: str, *, threads: int, cores=None, host=None, advertise_host=None
) -> dict:
    """Worker `<role>-<index>`: its identity, its threads and cores, a step trace and a disk
    tier of its own; the rest is the deployment's."""
    name = f"{role}-{index}"
    over = {
        "role": role,
        "router": router_url,
        "worker_id": name,
        "port": 0,  # the deployment's port is the front's; a worker's control API takes any free one
        "internal_aliases": None,  # the deployment's names are the front's or the router's
        "threads": threads,
        "cpu_cores": ",".join(str(c) for c in cores) if cores else None,
    }
    if host is not None:
        over["host"] = host
    if advertise_host is not None:
        over["advertise_host"] = advertise_host
    if args.step_trace:
        over["step_trace"] = f"{args.step_trace}.{name}.jsonl"
    if args.kv_disk_dir:  # a directory each: a disk tier's bound is its own
        over["kv_disk_dir"] = os.path.join(args.kv_disk_dir, name)
    return child_settings(args, "worker", **over)


class ConfigDir:
    """The children's config files: one private directory (0700, files 0600) for the
    deployment's life, removed when it stops."""

    def __init__(self):
        self.path = tempfile.mkdtemp(prefix="pdserve-serve-")

    def write(self, name: str, doc: dict) -> str:
        """`<dir>/<name>.json`: the child's name shows in its command line (ps, tools)."""
        return flags.write_private_json(os.path.join(self.path, f"{name}.json"), doc)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]


def _threads(args, cores=None) -> int:
    """The cores shared out evenly between the workers; --threads wins if given."""
    n = len(cores if cores is not None else _cores())
    return args.threads or max(1, n // max(1, args.prefill + args.decode))


def _placement(args, cores: list[int]) -> list[tuple[str, list[int] | None]]:
    """(role, cores) of each worker the deployment starts with: its share of `cores`, or
    --threads each, while cores last; None (unpinned) when they do not, or with --no-pin."""
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    threads = _threads(args, cores)
    pin = len(roles) * threads <= len(cores) and args.pin
    return [(role, cores[i * threads : (i + 1) * threads] if pin else None) for i, role in enumerate(roles)]


def _relay_cores(placement, cores: list[int]) -> list[int] | None:
    """Where the router and the front run: on the cores no worker was given, if any are left,
    else on the decode workers' cores. Their work is per token (streaming each chunk to its
    client), as decode's is, while a prefill core is busy for seconds at a time with a long
    prompt; on the prefill core they queue behind it and the long prompts' own TTFT grows (the
    mixed workload of docs/interference.md: 29 s -> 16 s when moved). None when the workers
    are not pinned: then the OS places everything."""
    given = {c for _, cs in placement if cs for c in cs}
    if not given:
        return None
    spare = sorted(set(cores) - given)
    return spare or sorted({c for role, cs in placement if role == "decode" and cs for c in cs}) or None


def _initial_workers(args, router_url: str, placement, threads: int) -> list[tuple[str, str, dict]]:
    """(role, worker id, settings) of the workers the deployment starts with, placed by `_placement`."""
    return [
        (role, f"{role}-{i}", worker_settings(args, role, i, router_url, threads=threads, cores=cores))
        for i, (role, cores) in enumerate(placement)
    ]


def _child_env(args) -> dict:
    env = dict(os.environ)
    if args.api_key:
        env["PDSERVE_API_KEY"] = args.api_key  # the router reads it; kept off the command line (ps)
    if getattr(args, "cluster_token_file", None):
        env[auth.TOKEN_FILE_ENV] = os.path.abspath(args.cluster_token_file)
    elif not env.get(auth.TOKEN_ENV):
        env[auth.TOKEN_ENV] = auth.new_token()  # one secret per deployment
    return env


class Child:
    """One supervised process: restarted with backoff whenever it crashes. A worker that
    exits 0 was drained on purpose (its pool shrank, or someone stopped it): retired."""

    # where decode workers keep their KV caches as files (--kv-shm-dir): a child that died
    # without its exit handlers leaves them there, in RAM, until swept
    shm_dir = ""

    def __init__(self, name: str, cmd: list[str], env: dict, role: str = "router", pass_fds=(), cores=None):
        self.name, self.cmd, self.env, self.role, self.pass_fds = name, cmd, env, role, tuple(pass_fds)
        self.cores = set(cores) if cores else None  # pinned to these from its first instruction, restarts too
        self.retired = False
        self.restarts = 0
        self.restarts_in_row = 0  # since it last ran for STABLE_S: sets the backoff
        self.proc: subprocess.Popen | None = None
        self.started_s = 0.0
        self.restart_at_s: float | None = None
        self.start()

    def start(self) -> None:
        env = {**self.env, RESTARTS_ENV: str(self.restarts)}
        # own session: a terminal's Ctrl-C reaches only us, and we stop the children in order
        self.proc = subprocess.Popen(
            self.cmd, env=env, start_new_session=True, preexec_fn=self._preexec, pass_fds=self.pass_fds
        )
        self.started_s = time.monotonic()
        self.restart_at_s = None

    def _preexec(self) -> None:
        die_with_parent()
        if self.cores:
            os.sched_setaffinity(0, self.cores)

    def tend(self, now: float) -> None:
        """Reap an exited child and restart it when its backoff has passed."""
        if self.restart_at_s is None:
            code = self.proc.poll()
            if code is None:
                return
            self._sweep()
            if code == USAGE_ERROR:
                raise ConfigError(f"{self.name} refused its configuration (exit code {code}); see its error above")
            if code == 0 and self.role != "router":
                self.retired = True
                log.info("%s left its pool (exit 0): not restarted", self.name)
                return
            if now - self.started_s > STABLE_S:
                self.restarts_in_row = 0
            delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**self.restarts_in_row)
            self.restarts_in_row += 1
            self.restart_at_s = now + delay
            log.warning("%s exited with code %s; restarting in %.1f s", self.name, code, delay)
        elif now >= self.restart_at_s:
            self.restarts += 1
            log.warning("%s: restart #%d", self.name, self.restarts)
            self.start()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, deadline_s: float) -> None:
        try:
            self.proc.wait(max(0.1, deadline_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in time; killing it", self.name)
            self.proc.kill()
            self.proc.wait()
            self._sweep()

    def _sweep(self) -> None:
        if self.role != "router" and self.shm_dir:
            removed = sweep_stale_kv_files(self.shm_dir)
            if removed:
                log.info("%s: removed %d KV cache files it left in %s", self.name, len(removed), self.shm_dir)


def launch(args) -> int:
    env = _child_env(args)
    os.environ.update({k: env[k] for k in (auth.TOKEN_ENV, auth.TOKEN_FILE_ENV) if k in env})
    try:
        auth.load_cluster_secret()  # an unreadable token file: said before anything starts
    except ValueError as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return USAGE_ERROR
    try:
        listener = _listen(args.host, args.port)
    except OSError as e:
        print(f"pdserve serve: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return USAGE_ERROR
    configs = ConfigDir()
    try:
        return _launch(args, env, listener, configs)
    finally:
        configs.remove()


def _command(configs: ConfigDir, command: str, name: str, settings: dict) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", command, "--config", configs.write(name, settings)]


def _launch(args, env: dict, listener: socket.socket, configs: ConfigDir) -> int:
    internal = _listen(LOOPBACK, 0)
    fd, port = internal.fileno(), internal.getsockname()[1]
    router_url = f"http://{LOOPBACK}:{port}"  # the workers started here skip the front
    secret = auth.load_cluster_secret()
    Child.shm_dir = getattr(args, "kv_shm_dir", "")
    router_cmd = _command(configs, "router", "router", router_settings(args, LOOPBACK, port, public=False))
    cores = _cores()
    placement = _placement(args, cores)
    relay = _relay_cores(placement, cores)
    if relay:
        log.info("router and front on cores %s", ",".join(map(str, relay)))
    router = Child("router", router_cmd + ["--fd", str(fd)], env, pass_fds=(fd,), cores=relay)
    workers = [
        Child(name, _command(configs, "worker", name, settings), env, role)
        for role, name, settings in _initial_workers(args, router_url, placement, _threads(args, cores))
    ]
    pools = _Pools(args, env, workers, secret, router_url, configs)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per forwarded request is noise
    front = _FrontThread(
        Front(router_url, secret, args.max_request_body_bytes, aliases=args.internal_aliases), listener, cores=relay
    )
    return _supervise(router, pools, args.shutdown_timeout, front, internal)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket held here for the deployment's life. The router's: a router that
    crashes and restarts takes over its queue, so the front's requests wait rather than
    being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    sock.set_inheritable(True)
    return sock


class _Pools:
    """The workers, kept at the router's wanted pool sizes: new ones started when a pool
    grows (the router drains the ones it removes itself)."""

    def __init__(self, args, env, workers: list[Child], secret: bytes, router_url: str, configs: ConfigDir):
        self.args, self.env, self.configs = args, env, configs
        self.workers = workers
        self.next_index = len(workers)
        self.router_url = router_url
        self.url = f"{router_url}/internal/admin/pools/poll"
        self.http = httpx.Client(auth=auth.http_auth(secret), timeout=2, trust_env=False)
        self.polled_s = 0.0
        self.answered_s = 0.0  # when the router last answered a poll

    def running(self) -> dict[str, int]:
        live = [w for w in self.workers if not w.retired]
        return {role: sum(w.role == role for w in live) for role in ("prefill", "decode")}

    def reconcile(self, now: float, router: Child) -> None:
        self.workers = [w for w in self.workers if not w.retired]
        if now - self.polled_s < 1.0:
            return
        self.polled_s = now
        running = self.running()
        try:
            r = self.http.post(self.url, json=PoolPollRequest(running=running).wire())
            wanted = PoolPollResponse.model_validate(r.json()).wanted if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            # (re)starting, or hung: one that answered since it started and went silent is hung
            silent_s = time.monotonic() - self.answered_s
            if self.answered_s > router.started_s and silent_s > ROUTER_HUNG_S and router.proc.poll() is None:
                log.error("the router has not answered for %.0f s: killing it so that it restarts", silent_s)
                router.proc.kill()
            return
        self.answered_s = time.monotonic()
        for role in ("prefill", "decode"):
            for _ in range(max(0, (wanted or {}).get(role, 0) - running[role])):
                name = f"{role}-{self.next_index}"
                log.info("pool %s grows: starting %s", role, name)
                settings = worker_settings(
                    self.args, role, self.next_index, self.router_url, threads=_threads(self.args)
                )
                self.workers.append(Child(name, _command(self.configs, "worker", name, settings), self.env, role))
                self.next_index += 1


class _FrontThread:
    """The front's own event loop and uvicorn server, on a thread of the launcher, serving
    the deployment's public listener."""

    def __init__(self, front: Front, listener: socket.socket, cores=None):
        import uvicorn

        self.front, self.listener = front, listener
        config = uvicorn.Config(front, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)

        def run():
            if cores:  # this thread only (and the threads it starts): the launcher's own children
                os.sched_setaffinity(0, set(cores))  # started later keep the launcher's cores
            asyncio.run(self.server.serve(sockets=[listener]))

        self.thread = threading.Thread(target=run, name="front", daemon=True)
        self.thread.start()

    def refuse_new(self) -> None:
        """New generation requests get 503 with Retry-After from now on."""
        self.front.draining = True

    def wait_idle(self, deadline_s: float) -> None:
        """Until the requests in flight are done, or the deadline."""
        while self.front.in_flight and time.monotonic() < deadline_s:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.listener.close()


def _supervise(router: Child, pools: _Pools, grace_s: float, front: _FrontThread, internal: socket.socket) -> int:
    stopping = False

    def stop(sig, frame):
        nonlocal stopping
        if stopping:  # a second signal: no more waiting
            for c in [router, *pools.workers]:
                c.signal(signal.SIGKILL)
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    while not stopping:
        now = time.monotonic()
        try:
            for c in [router, *pools.workers]:
                c.tend(now)
            pools.reconcile(now, router)
        except ConfigError as e:
            log.error("%s: stopping the deployment", e)
            code, stopping = USAGE_ERROR, True
        time.sleep(0.2)
    # The front refuses new requests (503, Retry-After) and the router drains: what is in
    # flight finishes on the workers, which go last.
    front.refuse_new()
    router.signal(signal.SIGTERM)
    internal.close()
    deadline = time.monotonic() + grace_s + 10
    front.wait_idle(deadline)
    router.wait(deadline)
    front.stop()
    for w in pools.workers:
        w.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s + 10
    for w in pools.workers:
        w.wait(deadline)
    return code
