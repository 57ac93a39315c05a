"""gRPC `Reward.Score` (`--grpc-port`): the stream path's scoring, answered synchronously.

For eval loops and agents that want a verdict now rather than through `{run}:scored`. It uses
the same GroupScorer as the stream path, so verdicts, rewards and reasons are identical; the
caller's trace context arrives in the gRPC metadata. Nothing is published on a stream, and
nothing in a request can choose code: the reward is the run config's (see compat/plugins.py).
"""

from __future__ import annotations

import logging

import grpc
from opentelemetry.trace import SpanKind

from millstream.common import telemetry
from millstream.common.errors import MillstreamError
from millstream.common.pb import services_pb2, services_pb2_grpc

from .scorer import GroupScorer
from .worker import score_traced

log = logging.getLogger("millstream.reward")


class RewardService(services_pb2_grpc.RewardServicer):
    def __init__(self, scorer: GroupScorer):
        self.scorer = scorer

    async def Score(
        self, request: services_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> services_pb2.ScoreResponse:
        if not request.HasField("group"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ScoreRequest.group is missing")
        parent = telemetry.context_from_grpc_metadata(context.invocation_metadata())
        rpc = telemetry.rpc_attributes("Reward", "Score")
        scored, _fields = await score_traced(
            self.scorer, request.group, parent, SpanKind.SERVER, "millstream.v1.Reward/Score", rpc
        )
        return services_pb2.ScoreResponse(scored=scored)


async def start_server(
    scorer: GroupScorer, port: int, host: str = "[::]"
) -> tuple[grpc.aio.Server, int]:
    """A started grpc.aio server hosting Reward; returns it and the bound port."""
    server = grpc.aio.server()
    services_pb2_grpc.add_RewardServicer_to_server(RewardService(scorer), server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise MillstreamError(
            f"cannot serve gRPC Reward on {host}:{port}: port in use? (--grpc-port, 0 picks one)"
        )
    await server.start()
    return server, bound
