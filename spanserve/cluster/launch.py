"""Start N replicas and the ingress on Ray Serve (`spanserve serve --replicas N`), and stop them."""

import logging
import os
import time

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from spanserve.cluster.ingress import Ingress
from spanserve.cluster.replica import EngineReplica, ServerOptions
from spanserve.cluster.router import SpanAwareRouter
from spanserve.config import EngineConfig
from spanserve.errors import SpanserveError
from spanserve.sessions.disk import SessionDisk

log = logging.getLogger("spanserve.cluster")
APP = "spanserve"
REPLICA_DEPLOYMENT = "EngineReplica"
STATS_PERIOD_S = 0.5  # how often each replica publishes its load and keys
MAX_ONGOING = 256  # HTTP requests one replica takes at once (its engine batches and queues them)
CONSTRUCTOR_RETRIES = 3  # a replica whose engine fails to build this often fails the start


class ClusterError(SpanserveError):
    """The cluster cannot start as asked (too few CPUs or GPUs, an unknown router)."""


def start(config: EngineConfig, options: ServerOptions, replicas: int, host: str = "127.0.0.1", port: int = 8000,
          ray_address: str | None = None, replica_cpus: float = 1.0, replica_gpus: float = 0.0) -> str:
    """Start Ray (in this process, unless `ray_address` names a cluster), Serve's HTTP proxy on
    host:port, `replicas` engine replicas and the ingress; return the URL once all are running."""
    if replicas < 1 or replica_cpus <= 0 or replica_gpus < 0:
        raise ClusterError("--replicas must be at least 1, --replica-cpus above 0 and --replica-gpus at least 0")
    router_class = _router_class(options.router)
    options.tenants()  # a bad keys file fails now, not in every replica
    began, started = time.monotonic(), not ray.is_initialized()
    if started and ray_address:
        ray.init(address=ray_address, logging_level=logging.WARNING)
    elif started:
        ray.init(num_cpus=_cpus(), include_dashboard=False, logging_level=logging.WARNING)
    free = ray.available_resources()
    for name, each in (("GPU", replica_gpus), ("CPU", replica_cpus)):
        if replicas * each > free.get(name, 0):
            if started:
                ray.shutdown()
            flag = f"--replica-{name.lower()}s"
            raise ClusterError(f"{replicas} replicas of {each:g} {name}s need {replicas * each:g} {name}s; Ray sees "
                               f"{free.get(name, 0):g} free: ask for fewer --replicas, or a smaller {flag} to let "
                               "them share")
    log.info("Ray started in %.1f s", time.monotonic() - began)
    serve.start(http_options={"host": host, "port": port})
    router = RequestRouterConfig(request_router_class=router_class,
                                 request_routing_stats_period_s=STATS_PERIOD_S, request_routing_stats_timeout_s=2)
    replica = serve.deployment(EngineReplica, name=REPLICA_DEPLOYMENT).options(
        num_replicas=replicas, ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        max_ongoing_requests=MAX_ONGOING,
        request_router_config=router, health_check_period_s=1, health_check_timeout_s=10,
        max_constructor_retry_count=CONSTRUCTOR_RETRIES)
    ingress = serve.deployment(Ingress, name="Ingress").options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=MAX_ONGOING * replicas)
    try:
        serve.run(ingress.bind(replica.bind(config, options), options, config.model), name=APP, route_prefix="/")
    except RuntimeError:  # every try at building a replica failed (a model that does not load)
        cause = _replica_failure()
        stop(started)
        raise ClusterError(f"the replicas could not start: {cause}") from None
    log.info("cluster of %d replicas running %.1f s after start", replicas, time.monotonic() - began)
    return f"http://{host}:{port}"


def _router_class(name: str):
    if name == "span":
        return SpanAwareRouter
    from spanserve.cluster.baselines import ROUTERS  # Ray's prefix router takes a while to import

    if name not in ROUTERS:
        raise ClusterError(f"--router must be span or one of {', '.join(ROUTERS)}, not {name!r}")
    return ROUTERS[name]


def _cpus() -> int:
    """The CPUs this process may run on (a container's share, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def stop(ray_too: bool = True) -> None:
    """Stop Serve, and Ray too unless `ray_too` is False (Ray this process did not start)."""
    if ray.is_initialized():
        serve.shutdown()
        if ray_too:
            ray.shutdown()


def _replica_failure() -> str:
    """Why the replicas failed to start, from Serve's status: the last line of their error."""
    try:
        message = serve.status().applications[APP].deployments[REPLICA_DEPLOYMENT].message
    except Exception:  # noqa: BLE001 - the status itself is gone: say what we know
        return "see Ray Serve's logs"
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else "see Ray Serve's logs"


def serve_cluster(args, config: EngineConfig, sessions: SessionDisk | None) -> None:
    """`spanserve serve --replicas N`: start, print the URL, serve until Ctrl-C, stop."""
    options = ServerOptions.from_args(args, sessions)
    url = start(config, options, args.replicas, args.host, args.port, args.ray_address, args.replica_cpus,
                args.replica_gpus)
    print(f"spanserve serving {options.model_name} on {url}/v1 ({args.replicas} replicas)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stop()
