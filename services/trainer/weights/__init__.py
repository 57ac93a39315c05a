"""Getting the trainer's weights to the engines (DESIGN.md section 5), trainer rank 0's side.

Owns the coordinator handshake (`sync`: pause, group, buckets, serve), the published policy
version and engine joins (`coordinator`, the gRPC service), and the transports' rank 0
(`process_group`: the weight update group and its buckets), the router's admin calls that
ride out a router restart (`router_admin`), and the engines kept in routing between syncs
and waited for when none is left (`keeper`). Invariant: an engine serves version V only once
it holds V's weights; a sync never hangs (every step has a timeout).
"""
