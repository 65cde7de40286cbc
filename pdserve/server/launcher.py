"""`pdserve serve` in disaggregated mode: a router plus N prefill and M decode workers on this host.

Each part is the same process an operator would start by hand (`pdserve
router`, `pdserve worker`); this launcher starts them, spreads the workers over
the cores, and supervises. Clients connect to the launcher itself: its front
(front.py) forwards every request to the router on a loopback port and resumes
the streams of a router that dies, so a router crash costs a pause, not answers.

- a fresh cluster secret per deployment (unless one is given), handed to the
  children in their environment, never on a command line;
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
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from pdserve import auth
from pdserve.control_api import PoolPollRequest, PoolPollResponse
from pdserve.engine.cli import TIER_FLAGS
from pdserve.ports import die_with_parent
from pdserve.server.front import Front

log = logging.getLogger("pdserve.launcher")

ENGINE_FLAGS = (
    "dtype",
    "device",
    "block_size",
    "num_gpu_blocks",
    "kv_cache_memory_bytes",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "long_prefill_token_threshold",
)
BACKOFF_FIRST_S, BACKOFF_MAX_S, STABLE_S = 0.5, 30.0, 60.0
RESTARTS_ENV = "PDSERVE_RESTARTS"  # in each worker's environment: how often it was restarted (it tells the router)
LOOPBACK = "127.0.0.1"
USAGE_ERROR = 2  # what a pdserve command exits with for bad flags or config: restarting cannot help


class ConfigError(RuntimeError):
    """A child refused its configuration."""


def _engine_args(args) -> list[str]:
    out = []
    for name in ENGINE_FLAGS:
        v = getattr(args, name, None)
        if v is not None:
            out += [f"--{name.replace('_', '-')}", str(v)]
    if not args.enable_chunked_prefill:
        out.append("--no-enable-chunked-prefill")
    if not args.enable_prefix_caching:
        out.append("--no-enable-prefix-caching")
    if getattr(args, "int8_activations", None) is not None:
        out.append("--int8-activations" if args.int8_activations else "--no-int8-activations")
    if getattr(args, "policy", "fcfs") != "fcfs":
        out += ["--scheduling-policy", args.policy]
    for name in TIER_FLAGS + ("kv_transfer_headroom",):
        v = getattr(args, name, None)
        if v not in (None, ""):
            out += [f"--{name.replace('_', '-')}", str(v)]
    return out + (["--model", args.model] if args.model else [])


def _flags(args, names) -> list[str]:
    """`--name value` for each of the flags that were set."""
    out = []
    for name in names:
        v = getattr(args, name, None)
        if v is not None:
            out += ["--" + name.replace("_", "-"), str(v)]
    return out


def _router_cmd(py, args, host: str | None = None, port: int | None = None) -> list[str]:
    """The router's flags that were set: early rejection (each off unless given), the KV
    bandwidth for its TTFT model, its timeouts and limits (the router's defaults otherwise).
    It listens on host:port (default: the deployment's --host and --port)."""
    host, port = host or args.host, port or args.port
    cmd = py + [
        "router",
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        args.router_policy,
        "--kv-mode",
        args.kv_mode,
        "--log-level",
        args.log_level,
        "--log-format",
        args.log_format,
        *_flags(
            args,
            (
                "slo_ttft_ms",
                "slo_tpot_ms",
                "kv_watermark",
                "kv_bandwidth_gbps",
                "worker_timeout_s",
                "kv_timeout_s",
                "max_request_body_bytes",
                "shutdown_timeout",
                "max_seqs_per_request",
            ),
        ),
    ]
    if getattr(args, "metrics_require_key", False):
        cmd.append("--metrics-require-key")
    if getattr(args, "autoscale", False):
        cmd += [
            "--autoscale",
            *_flags(
                args,
                (
                    "min_prefill",
                    "max_prefill",
                    "min_decode",
                    "max_decode",
                    "autoscale_cooldown_s",
                    "autoscale_interval_s",
                ),
            ),
        ]
    if args.model:
        cmd += ["--model", args.model]
    if args.served_model_name:
        cmd += ["--served-model-name", *args.served_model_name]
    return cmd


def _worker_cmd(py, args, role: str, index: int, pinned_cores: list[int] | None, router_url: str) -> list[str]:
    cmd = py + [
        "worker",
        "--role",
        role,
        "--router",
        router_url,
        "--host",
        args.host,
        "--worker-id",
        f"{role}-{index}",
        "--log-level",
        args.log_level,
        "--log-format",
        args.log_format,
        *_flags(args, ("shutdown_timeout", "max_waiting_requests")),
        *_engine_args(args),
    ]
    cores = _cores()
    # one core each while cores last; the threads flag still wins if given
    threads = args.threads or max(1, len(cores) // max(1, args.prefill + args.decode))
    cmd += ["--threads", str(threads)]
    if pinned_cores:
        cmd += ["--cpu-cores", ",".join(str(c) for c in pinned_cores)]
    if not args.kv_layerwise:
        cmd.append("--no-kv-layerwise")
    cmd += ["--kv-wire", args.kv_wire, "--kv-transport", args.kv_transport]
    if getattr(args, "step_trace", None):
        cmd += ["--step-trace", f"{args.step_trace}.{role}-{index}.jsonl"]
    if getattr(args, "kv_disk_dir", ""):  # a directory each: a disk tier's bound is its own
        cmd += ["--kv-disk-dir", os.path.join(args.kv_disk_dir, f"{role}-{index}")]
    return cmd


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]


def _initial_workers(py, args, router_url: str) -> list[tuple[str, str, list[str]]]:
    """(role, worker id, command) of the workers the deployment starts with."""
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    cores = _cores()
    threads = args.threads or max(1, len(cores) // len(roles))
    pin = len(roles) <= len(cores) and not args.no_pin
    return [
        (
            role,
            f"{role}-{i}",
            _worker_cmd(py, args, role, i, cores[i * threads : (i + 1) * threads] if pin else None, router_url),
        )
        for i, role in enumerate(roles)
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

    def __init__(self, name: str, cmd: list[str], env: dict, role: str = "router", pass_fds=()):
        self.name, self.cmd, self.env, self.role, self.pass_fds = name, cmd, env, role, tuple(pass_fds)
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
            self.cmd, env=env, start_new_session=True, preexec_fn=die_with_parent, pass_fds=self.pass_fds
        )
        self.started_s = time.monotonic()
        self.restart_at_s = None

    def tend(self, now: float) -> None:
        """Reap an exited child and restart it when its backoff has passed."""
        if self.restart_at_s is None:
            code = self.proc.poll()
            if code is None:
                return
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


def launch(args) -> int:
    py = [sys.executable, "-m", "pdserve.cli"]
    env = _child_env(args)
    os.environ.update({k: env[k] for k in (auth.TOKEN_ENV, auth.TOKEN_FILE_ENV) if k in env})
    try:
        listener = _listen(args.host, args.port)
    except OSError as e:
        print(f"pdserve serve: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return USAGE_ERROR
    internal = _listen(LOOPBACK, 0)
    fd, port = internal.fileno(), internal.getsockname()[1]
    router_url = f"http://{LOOPBACK}:{port}"  # the workers started here skip the front
    secret = auth.load_cluster_secret()
    router = Child("router", _router_cmd(py, args, LOOPBACK, port) + ["--fd", str(fd)], env, pass_fds=(fd,))
    workers = [Child(name, cmd, env, role) for role, name, cmd in _initial_workers(py, args, router_url)]
    pools = _Pools(py, args, env, workers, secret, router_url)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per forwarded request is noise
    front = _FrontThread(Front(router_url, secret, args.max_request_body_bytes), listener)
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

    def __init__(self, py, args, env, workers: list[Child], secret: bytes, router_url: str):
        self.py, self.args, self.env = py, args, env
        self.workers = workers
        self.next_index = len(workers)
        self.router_url = router_url
        self.url = f"{router_url}/internal/admin/pools/poll"
        self.http = httpx.Client(auth=auth.http_auth(secret), timeout=2)
        self.polled_s = 0.0

    def running(self) -> dict[str, int]:
        live = [w for w in self.workers if not w.retired]
        return {role: sum(w.role == role for w in live) for role in ("prefill", "decode")}

    def reconcile(self, now: float) -> None:
        self.workers = [w for w in self.workers if not w.retired]
        if now - self.polled_s < 1.0:
            return
        self.polled_s = now
        running = self.running()
        try:
            r = self.http.post(self.url, json=PoolPollRequest(running=running).wire())
            wanted = PoolPollResponse.model_validate(r.json()).wanted if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return  # the router is (re)starting: try again next round
        for role in ("prefill", "decode"):
            for _ in range(max(0, (wanted or {}).get(role, 0) - running[role])):
                name = f"{role}-{self.next_index}"
                log.info("pool %s grows: starting %s", role, name)
                self.workers.append(
                    Child(
                        name,
                        _worker_cmd(self.py, self.args, role, self.next_index, None, self.router_url),
                        self.env,
                        role,
                    )
                )
                self.next_index += 1


class _FrontThread:
    """The front's own event loop and uvicorn server, on a thread of the launcher, serving
    the deployment's public listener."""

    def __init__(self, front: Front, listener: socket.socket):
        import uvicorn

        self.front, self.listener = front, listener
        config = uvicorn.Config(front, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[listener])), name="front", daemon=True
        )
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
            pools.reconcile(now)
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
