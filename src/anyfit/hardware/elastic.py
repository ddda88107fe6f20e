"""The process group of a job torchrun restarted on one machine.

torchrun's static rendezvous (what ``torchrun --nproc_per_node N`` uses) keeps one key-value store for the
job's whole life, and since PyTorch 2.4 a worker's ``init_process_group`` no longer keys its entries by the
attempt ("a new TCPStore for every retry", which holds for the c10d rendezvous only). A restarted worker then
reads the addresses the dead attempt left and fails to connect ("Gloo connectFullMesh failed ... Connection
refused") or waits forever: the family of pytorch#135712. Here the restarted workers of a one-machine job set
their process group up on the agent's store under a prefix of their own attempt, as PyTorch did before;
Accelerate finds it set up and uses it.

Only for one machine (``GROUP_WORLD_SIZE`` 1): there every worker has the same restart count. Across
machines torchrun counts restarts per machine (pytorch#108158), and the c10d rendezvous that multi-machine
restarts need gives every attempt a fresh store, so nothing is done there.
"""

from __future__ import annotations

import os
from datetime import timedelta


def restarted_attempt(environ=os.environ) -> int:
    """The attempt whose process group needs its own keys (0: none does)."""
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if not attempt.isdigit() or environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return 0
    return int(attempt) if environ.get("GROUP_WORLD_SIZE") == "1" else 0


def init_restarted_process_group(backend: str, timeout: timedelta = timedelta(minutes=10)) -> bool:
    """Set up the default process group on this attempt's keys, when this is a restarted one-machine job
    (True); otherwise leave it to Accelerate (False)."""
    import torch.distributed as dist

    attempt = restarted_attempt()
    if attempt == 0 or dist.is_initialized():
        return False
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"anyfit/attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=world, timeout=timeout)
    return True
