"""Rendezvous stores rewrite hosts itself: torch's TCPStore, on ports torch binds.

`local_store` hosts one for ranks started here (`launch`, a world-of-one `train`);
`restart_store` gives each of torchrun's restarts a key space of its own in the agent's store.
"""

from __future__ import annotations

import os
from datetime import timedelta

__all__ = ["local_store", "restart_store", "restart_hazard"]


def local_store(world_size: int, timeout: timedelta):
    """A rendezvous store on 127.0.0.1, on a port the kernel picks as torch binds it.

    Hosted here for the ranks to join as clients (torchrun's agent store, told by
    TORCHELASTIC_USE_AGENT_STORE=True): no port is chosen, freed and then taken by another
    process in between, as a probed "free" port may be. Keep it alive while the ranks run.
    """
    import torch.distributed as dist  # here: a worker's bootstrap imports this module before torch

    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)


def restart_store(timeout: timedelta) -> dict:
    """Under torchrun's agent store, a key space of this restart's own: `store`, `rank`, `world_size`.

    torchrun (`--max-restarts`) starts the new workers against the same agent store, which
    still holds the process-group keys of the workers it replaced: gloo would read the
    addresses of dead ranks and fail to connect. Prefixing the keys with the restart count
    gives every attempt fresh ones. Elsewhere: nothing (the `env://` default).

    The count is each agent's own, and agents on several machines may disagree on it (one
    restarts because its workers failed, another because the membership changed; torch
    issue 135712): `restart_hazard` says when that can bite.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    world = int(os.environ["WORLD_SIZE"])
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return {"store": dist.PrefixStore(f"rewrite/attempt_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": world}


def restart_hazard() -> str | None:
    """Why restarts could fail here, or None: several machines, torchrun's shared store, restarts allowed.

    Then the machines' workers may key a restart by different counts and read the addresses of
    dead ranks. torchrun without the shared store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every
    machine) starts each attempt on a fresh store instead.
    """
    env = os.environ
    several = int(env.get("GROUP_WORLD_SIZE", "1")) > 1
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    if not (several and restarts and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        return None
    return ("torchrun may restart this run (--max-restarts) across several machines with its shared rendezvous "
            "store, where torch 2.13 can start a restart on stale addresses (its issue 135712): set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun on every machine")
