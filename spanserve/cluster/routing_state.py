"""What the routers of a process share with its ingress: their counts by reason, and themselves.

Ray Serve ships the router class by value (the module router.py is pickled with it), so globals
of router.py are a copy in the ingress's process; this module is imported by name there, and the
router reaches it as a module (`routing_state.ROUTED`), never by its objects.
"""

import weakref

from prometheus_client import CollectorRegistry, Counter, Histogram

REGISTRY = CollectorRegistry()  # this process's routing counts (the ingress's process)
ROUTED = Counter("spanserve_routed_requests", "Requests routed to a replica, by why: pinned (a session's call, "
                 "or a scrape of that replica), cache (it holds the most of the prompt's blocks), load (power "
                 "of two choices: no replica holds any)", ["replica", "reason"], registry=REGISTRY)
_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1)
KEYS_SECONDS = Histogram("spanserve_routing_keys_seconds", "Time the ingress took to tokenize and hash a "
                         "request's prompt into routing keys", buckets=_BUCKETS, registry=REGISTRY)
CHOICE_SECONDS = Histogram("spanserve_routing_choice_seconds", "Time the span-aware router took to rank the "
                           "replicas for a request", buckets=_BUCKETS, registry=REGISTRY)
ROUTERS: weakref.WeakSet = weakref.WeakSet()  # the routers of this process


def replica_ids() -> list[str]:
    """The replicas this process's routers see running (the ingress's fan-out of /metrics)."""
    return sorted({rid.unique_id for router in list(ROUTERS) for rid in router.curr_replicas})
