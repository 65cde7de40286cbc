"""`pdserve serve --ray`: the same deployment, placed and kept alive by a Ray cluster.

Each pdserve process (the router, every prefill and decode worker) runs under
a Ray actor of its own (`PdserveProcess`), on the node Ray picks, with the
CPUs it asks for. The actor starts the very same command an operator would
(`pdserve router`, `pdserve worker`) bound to its node's address, and watches
it: when the process dies, the actor dies with it, and Ray restarts the actor
(`max_restarts`), which starts the process again. A worker that exits 0 was
drained on purpose (its pool shrank): the driver lets its actor go.

Placement: the workers' CPUs form one placement group; `--placement spread`
puts the bundles on different nodes where the cluster has them (prefill and
decode apart), `pack` keeps them together. The router runs on the driver's
node, so its URL is known before anything else starts.

What Ray does not carry: KV bytes (worker to worker over the KV bridge: TCP
between nodes, shared memory within one), and the request traffic. The
cluster secret reaches the actors as an argument (inside Ray's own
authenticated control plane); a local Ray started here has token
authentication on and its dashboard on loopback.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

import httpx
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from pdserve import auth
from pdserve.control_api import PoolPollRequest, PoolPollResponse
from pdserve.ports import die_with_parent
from pdserve.server.launcher import RESTARTS_ENV, ConfigDir, router_settings, worker_settings

log = logging.getLogger("pdserve.ray")
NODE_IP = "{node_ip}"  # replaced, in an actor, by the address of the node it landed on


class PdserveProcess:
    """A Ray actor around one pdserve process (made a remote class in `_actor_class`).

    It gets the process's settings as a dict (inside Ray's authenticated control plane)
    and hands them on as a config file on its own node, as `pdserve serve` does."""

    def __init__(self, name: str, role: str, command: str, settings: dict, env: dict):
        self.name, self.role = name, role
        self.node_ip = ray.util.get_node_ip_address()
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        restarts = 1 if ctx.was_current_actor_reconstructed else 0
        settings = {k: v.replace(NODE_IP, self.node_ip) if isinstance(v, str) else v for k, v in settings.items()}
        self.configs = ConfigDir()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", command, "--config", self.configs.write(name, settings)],
            env={**os.environ, **env, RESTARTS_ENV: str(restarts)},
            preexec_fn=die_with_parent,
        )
        self.stopping = False
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        code = self.proc.wait()
        self.configs.remove()
        if code != 0 and not self.stopping:
            # the process crashed: take the actor down with it, and Ray restarts both
            print(
                f"pdserve {self.name} exited with {code}; the actor exits for Ray to restart it",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)

    def info(self) -> dict:
        return {
            "name": self.name,
            "role": self.role,
            "node_ip": self.node_ip,
            "node_id": self.node_id,
            "pid": self.proc.pid,
            "exit_code": self.proc.poll(),
        }

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (a drain), then wait for the process to exit."""
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            # here too, not only in _watch: Ray may end the actor before that thread runs
            self.configs.remove()


def _actor_class(max_restarts: int):
    return ray.remote(max_restarts=max_restarts, max_task_retries=0)(PdserveProcess)


def _connect(args):
    """Join the cluster named by --ray-address, or start a local one that is safe by default."""
    if args.ray_address:
        ray.init(address=args.ray_address, namespace="pdserve", log_to_driver=True)
        return
    ray.init(
        namespace="pdserve",
        include_dashboard=False,
        dashboard_host="127.0.0.1",
        num_cpus=max(len(os.sched_getaffinity(0)), args.prefill + args.decode),
    )


def _worker_settings(args, role: str, index: int, router_url: str) -> dict:
    host = args.host or NODE_IP  # None: joined a cluster, and each node serves on its Ray address
    advertise = NODE_IP if host in ("0.0.0.0", "::") else host
    return worker_settings(
        args, role, index, router_url, threads=args.threads or 1, host=host, advertise_host=advertise
    )


def launch(args) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per supervisor poll is noise
    _connect(args)
    token = os.environ.get(auth.TOKEN_ENV) or auth.new_token()
    env = {auth.TOKEN_ENV: token, "OMP_NUM_THREADS": str(args.threads or 1)}
    if args.api_key:
        env["PDSERVE_API_KEY"] = args.api_key
    Actor = _actor_class(args.ray_max_restarts)
    here = ray.get_runtime_context().get_node_id()
    node_ip = ray.util.get_node_ip_address()
    host = args.host or node_ip
    router_url = f"http://{node_ip if host in ('0.0.0.0', '::') else host}:{args.port}"
    router = Actor.options(
        name="pdserve-router", num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)
    ).remote("router", "router", "router", router_settings(args, host, args.port), env)

    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    cpus = args.threads or 1
    pg = placement_group([{"CPU": cpus}] * len(roles), strategy="SPREAD" if args.placement == "spread" else "PACK")
    if not _ready(pg, 120):
        remove_placement_group(pg)
        ray.kill(router, no_restart=True)
        print(
            f"pdserve serve --ray: the cluster cannot place {len(roles)} workers of {cpus} CPU(s) each", file=sys.stderr
        )
        return 2
    workers = {}
    for i, role in enumerate(roles):
        workers[f"{role}-{i}"] = Actor.options(
            name=f"pdserve-{role}-{i}",
            num_cpus=cpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote(f"{role}-{i}", role, "worker", _worker_settings(args, role, i, router_url), env)
    log.info(
        "pdserve on Ray",
        extra={"fields": {"router": router_url, "workers": list(workers), "placement": args.placement}},
    )
    print(f"pdserve serve --ray: router at {router_url}", flush=True)
    http = httpx.Client(auth=auth.http_auth(token.encode()), timeout=5, trust_env=False)
    try:
        return _supervise(args, Actor, router, workers, router_url, http, env)
    finally:
        http.close()
        for a in [*workers.values(), router]:
            ray.kill(a, no_restart=True)
        remove_placement_group(pg)
        ray.shutdown()


def _ready(pg, timeout_s: float) -> bool:
    try:
        ray.get(pg.ready(), timeout=timeout_s)
        return True
    except ray.exceptions.GetTimeoutError:
        return False


def _supervise(args, Actor, router, workers: dict, router_url: str, http, env: dict) -> int:
    """Until SIGTERM / SIGINT: grow pools the router wants bigger, let retired workers go.
    Then drain: the router first, then the workers."""
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    next_index = len(workers)
    while not stopping.wait(1.0):
        for name, a in list(workers.items()):
            try:
                info = ray.get(a.info.remote(), timeout=5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue  # restarting, or busy: Ray is on it
            if info["exit_code"] == 0:
                log.info("%s left its pool: its actor goes too", name)
                ray.kill(workers.pop(name), no_restart=True)
        running = {r: sum(n.startswith(r) for n in workers) for r in ("prefill", "decode")}
        try:
            r = http.post(router_url + "/internal/admin/pools/poll", json=PoolPollRequest(running=running).wire())
            wanted = PoolPollResponse.model_validate(r.json()).wanted
        except (httpx.HTTPError, ValueError):
            continue
        for role in ("prefill", "decode"):
            for _ in range(max(0, wanted.get(role, 0) - running[role])):
                name = f"{role}-{next_index}"
                log.info("pool %s grows: starting %s", role, name)
                workers[name] = Actor.options(name=f"pdserve-{name}", num_cpus=args.threads or 1).remote(
                    name, role, "worker", _worker_settings(args, role, next_index, router_url), env
                )
                next_index += 1
    grace = args.shutdown_timeout + 10
    ray.get(router.stop.remote(grace))
    ray.get([a.stop.remote(grace) for a in workers.values()])
    return 0
