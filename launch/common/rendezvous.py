"""The store a process group starts from, fresh on every restart of torchrun's workers.

Why: torchrun (torch >= 2.4, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` unset) hands its workers the
address of a TCPStore that its agent hosts, and ``init_process_group("env://")`` joins it as a
client (``TORCHELASTIC_USE_AGENT_STORE=True``) with no per-restart prefix. The agent creates that
store once and keeps it across ``--max-restarts``: after a worker dies, the restarted workers find
every key of the previous attempt still there. gloo's start (``_new_process_group_helper``) then
reads the *dead* workers' addresses, and each rank either connects to a closed port (connection
refused: the restart exits 1) or waits on a peer that never answers (a hang until the process-group
timeout, 30 minutes by default on gloo). NCCL reads a stale unique id the same way. Counting
restarts does not help across nodes: ``TORCHELASTIC_RESTART_COUNT`` is each agent's own count.

What :func:`elastic_store` does instead: rank 0 draws a new namespace (a random key prefix) and
publishes it in the agent's store; every other rank reads it and proves that it is current with a
hello / acknowledgement exchange with rank 0 inside it. A namespace left by a previous attempt
has no live rank 0 to acknowledge, so a rank that read it reads the key again until rank 0 of its
own attempt has replaced it. Every key of the process group then lies under the new prefix. This
relies on what torchrun guarantees: it stops every worker of an attempt, on every node, before it
starts any worker of the next one.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import uuid

import torch.distributed as dist

__all__ = ["HOST_KEY", "NAMESPACE_KEY", "elastic_store", "uses_agent_store"]

#: Key of the agent's store that holds the current attempt's namespace.
NAMESPACE_KEY = "distscaler/namespace"
#: Prefix of the keys (``HOST_KEY/<rank>``) holding the hostname each rank last ran on.
HOST_KEY = "distscaler/host"
#: How long a rank waits for rank 0's acknowledgement before it reads the namespace again.
_ACK_WAIT_S = 2.0
_POLL_S = 0.05


def uses_agent_store() -> bool:
    """Whether torchrun's agent hosts the store at ``MASTER_ADDR:MASTER_PORT`` for every attempt."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def elastic_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """A store for ``init_process_group(store=...)`` under the agent's store, private to this
    attempt of the workers (see the module docstring). Every rank of the world must call it.

    Raises:
        TimeoutError: rank 0 of this attempt did not show up within ``timeout``; on rank 0, some
            other rank did not (the message names those ranks and the host each last ran on).
    """
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout,
    )
    deadline = time.monotonic() + timeout.total_seconds()
    # Outside any attempt's namespace: a rank that does not come back is named by its last host.
    agent.set(f"{HOST_KEY}/{rank}", socket.gethostname())
    if rank == 0:
        namespace = f"distscaler/{uuid.uuid4().hex}"
        agent.set(NAMESPACE_KEY, namespace)
        for r in range(1, world_size):
            hello = f"{namespace}/hello/{r}"
            left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
            try:
                agent.wait([hello], left)  # the namespace is new: no stale key can answer this
            except dist.DistStoreError:
                raise TimeoutError(_missing_ranks(agent, namespace, world_size, timeout)) from None
            agent.set(f"{namespace}/ack/{r}", agent.get(hello))
    else:
        namespace = _join_current_namespace(agent, rank, deadline)
    return dist.PrefixStore(namespace, agent)


def _missing_ranks(
    agent: dist.Store, namespace: str, world_size: int, timeout: datetime.timedelta
) -> str:
    """Rank 0's message when ranks did not join this attempt: which, and on which host they ran
    before (a host that is down or cut off is the usual reason)."""
    missing = [r for r in range(1, world_size) if not agent.check([f"{namespace}/hello/{r}"])]
    hosts = {
        r: agent.get(f"{HOST_KEY}/{r}").decode() if agent.check([f"{HOST_KEY}/{r}"]) else None
        for r in missing
    }
    named = sorted({h for h in hosts.values() if h is not None})
    where = ", ".join(
        f"rank {r} (last on {h})" if h is not None else f"rank {r} (never seen)"
        for r, h in hosts.items()
    )
    return (
        f"rank 0: {len(missing)} of {world_size} rank(s) did not join the process group within "
        f"{timeout.total_seconds():g} s (dist_timeout_s): {where}"
        + (
            f"; is {' / '.join(named)} up and reachable from {socket.gethostname()}?"
            if named
            else ""
        )
    )


def _join_current_namespace(agent: dist.Store, rank: int, deadline: float) -> str:
    token = uuid.uuid4().hex.encode()
    while True:
        namespace = agent.get(NAMESPACE_KEY).decode()  # waits until a rank 0 has written one
        agent.set(f"{namespace}/hello/{rank}", token)
        ack = f"{namespace}/ack/{rank}"
        patience = time.monotonic() + _ACK_WAIT_S
        while time.monotonic() < min(patience, deadline):
            if agent.check([ack]) and agent.get(ack) == token:
                return namespace
            time.sleep(_POLL_S)
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"rank {rank}: rank 0 did not acknowledge namespace {namespace!r} of the store at "
                f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} before the "
                "process-group timeout"
            )
