"""The routers `spanserve serve --replicas N --router NAME` offers besides ours, to compare with it
(`spanserve bench cluster`): each honours a session's pin and the replicas seen dead as ours does
(router.pinned_or_alive), then routes by its own rule.

- round-robin: each replica in turn.
- pow2: Ray Serve's default, power of two choices by queue length.
- prefix: Ray's PrefixCacheAffinityRouter (the one `ray.serve.llm` uses), which matches the
  prompt's text against a prefix tree of what each replica was sent. It reads the prompt from a
  call argument with a `prompt` or `messages` attribute: the ingress adds one (its RequestText).
"""

import itertools

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from spanserve.cluster.router import pinned_or_alive


class _Pinned:
    """Sessions and dead replicas first, then the base router's rule over the live replicas."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return await super().choose_replicas(candidate_replicas, pending_request)
        alive, pinned = pinned_or_alive(candidate_replicas, pending_request.kwargs)
        if pinned:
            return [pinned]
        return await super().choose_replicas(alive, pending_request)


class _RoundRobin(RequestRouter):
    def initialize_state(self, **kwargs):
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if pending_request is None:
            return [candidate_replicas]
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        return [[ordered[next(self._turn) % len(ordered)]]]


class RoundRobinRouter(_Pinned, _RoundRobin):
    pass


class PowerOfTwoRouter(_Pinned, PowerOfTwoChoicesRequestRouter):
    pass


class PrefixAffinityRouter(_Pinned, PrefixCacheAffinityRouter):
    pass


ROUTERS = {"round-robin": RoundRobinRouter, "pow2": PowerOfTwoRouter, "prefix": PrefixAffinityRouter}
