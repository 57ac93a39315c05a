"""The admin token: one bearer scheme for the router, the engines and the Coordinator.

A caller proves it may change a service's state with `Authorization: Bearer <token>`: an
HTTP header for the router's and engines' admin endpoints, the gRPC metadata key
`authorization` for the Coordinator's JoinEngine. The token comes from `--admin-token` or
the environment (`MILLSTREAM_ADMIN_TOKEN`, so it stays out of process listings).

Invariants: with no token configured every endpoint is open (a local, loopback-only run);
with one, an admin call without the exact token is refused, and the comparison takes the
same time wherever the given token differs (`hmac.compare_digest`). Read-only and data-path
endpoints (health, info, /generate) never ask for it, as in SGLang, whose API key guards
only its admin routes. Nothing here logs or echoes a token.

`ENGINE_ADMIN_PATHS` is the one list of an engine's admin paths (SGLang's names): the engine
guards exactly these (engine/http/control.py, checked by tests/integration/test_admin_auth.py),
and the router asks its own token for them before it proxies one (router/proxy.py), whether
or not the engine behind has a token.

Imports no torch, FastAPI or gRPC: the router, the engine and the trainer all load it.
"""

from __future__ import annotations

import hmac

ADMIN_TOKEN_ENV = "MILLSTREAM_ADMIN_TOKEN"
NEEDS_TOKEN = "this endpoint needs `Authorization: Bearer <admin token>`"
WRONG_TOKEN = "wrong admin token"

ENGINE_ADMIN_PATHS = frozenset(
    {
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        "/update_weights_from_disk",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    }
)


def bearer_headers(token: str | None) -> dict[str, str]:
    """The header an admin call sends: none when no token is configured."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def is_engine_admin_path(path: str) -> bool:
    """`path` (as the router received it, percent-decoded) reaches an engine admin endpoint:
    repeated and trailing slashes do not hide one."""
    parts = [p for p in path.split("/") if p]
    return "/" + "/".join(parts) in ENGINE_ADMIN_PATHS


def refusal(authorization: str | None, token: str | None) -> str | None:
    """Why a call with this `Authorization` value is refused, or None when it may proceed."""
    if token is None:
        return None
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return NEEDS_TOKEN
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        return WRONG_TOKEN
    return None
