"""Getting the trainer's weights to the engines (docs/weight-sync.md), trainer rank 0's side.

Owns the coordinator handshake (`sync`: pause, route, push, serve; `delivery`: every engine
its buckets by its route; `engines`: what is known of each engine; `calls`: the engines'
admin calls), the weight routes (`routes/`: nccl, tensor, SGLang's format, disk, and the
choice among them; `fp8_weights`: FP8 weights for an FP8 SGLang server; `rendezvous`: an
update group left by a killed trainer), the published policy version and engine joins
(`coordinator`, the gRPC service), the router's admin calls that ride out a router restart
(`router_admin`), the engines kept in routing between syncs and waited for when none is left
(`keeper`), and --colocate's turns (`colocate`). Invariant: an engine serves version V only once
it holds V's weights; a sync never hangs (every step has a timeout).
"""
