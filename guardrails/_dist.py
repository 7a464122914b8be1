"""Where this process sits in a (possibly) distributed job.

Read once at guard start; nothing here issues a collective.
"""

from __future__ import annotations

import os

import torch.distributed as dist


def rank() -> int:
    """This process's global rank: the process group's if one is up, else torchrun's
    ``RANK`` variable, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))
