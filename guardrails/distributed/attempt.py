"""Which launch attempt this process belongs to, and a rendezvous that keeps attempts apart.

``torchrun --max-restarts N`` restarts every worker of a failed group. With
``TORCHELASTIC_USE_AGENT_STORE=True`` (the default of its static and c10d rendezvous)
the workers of *every* attempt are clients of the same ``TCPStore``, the one the agent
hosts for the whole job, and nothing in the key names tells the attempts apart: the
default group's keys (``default_pg/...``: gloo's peer addresses, NCCL's unique id,
pytorch/pytorch#167288) and guardrails' own (a hang verdict, a rank's end) are still
there when attempt 1 starts. Attempt 1 then reads attempt 0's addresses (gloo's
"connectFullMesh failed ... Connection refused", seen on torch 2.13) or attempt 0's
verdict as news (issue 50: a restarted run died at step 11 of the first attempt's
``HangError``).

Two fixes, independent of each other:

* :func:`key_prefix`: guardrails' side store puts every key under the attempt
  (``distributed/store.side_store``), whoever created the process group.
* :func:`namespaced_rendezvous`: while ``@guardrails.record``'s ``main`` runs, the
  ``env://`` and ``tcp://`` rendezvous (what ``init_process_group`` uses) yield a
  ``PrefixStore("guardrails-attempt<K>/", store)``, so the process group of attempt K
  shares no key with attempt K-1's.

**Only where one agent launched every rank** (``GROUP_WORLD_SIZE`` 1: a single-node
torchrun). There ``TORCHELASTIC_RESTART_COUNT`` is the same on every rank by
construction. Across nodes it is not: an agent whose own workers failed counts a restart,
while another node's agent, seeing the first one rejoin the rendezvous before its own
workers failed, restarts its group without counting one
(``torch/distributed/elastic/agent/server/api.py``, ``_invoke_run``). Ranks that named
their keys by different counts would never meet: a hang at the rendezvous, worse than
the bug. A multi-node restart keeps torch's key names.

The prefix is used from attempt 0 on (not only for restarts): every attempt then has a
namespace of its own, and none shares one with code that uses the store unprefixed.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

#: The rendezvous schemes wrapped: those whose store can be the agent's (torch's
#: ``_create_c10d_store``, used by both). ``file://`` makes a store of its own.
_SCHEMES = ("env", "tcp")


def number() -> int | None:
    """This process's attempt under a single-agent torchrun (0 for the first launch,
    K after K restarts), else ``None`` (see the module docstring for why not across
    nodes)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if count is None or not count.isdigit():
        return None
    agents = os.environ.get("GROUP_WORLD_SIZE")
    if agents is None:  # an older launcher: one agent when it launched every rank
        one_agent = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
    else:
        one_agent = agents == "1"
    return int(count) if one_agent else None


def key_prefix() -> str:
    """``"attempt<K>/"`` to put in front of guardrails' store keys, ``""`` when the
    attempt is unknown (not under torchrun, or several agents)."""
    k = number()
    return "" if k is None else f"attempt{k}/"


def _namespaced(original: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """``original`` rendezvous handler, its store under this attempt's prefix."""

    def handler(url: str, **kwargs: Any) -> Iterator[Any]:
        rendezvous = original(url, **kwargs)
        store, rank, world_size = next(rendezvous)
        k = number()
        if k is not None:
            store = dist.PrefixStore(f"guardrails-attempt{k}/", store)
        yield store, rank, world_size
        yield from rendezvous  # a re-rendezvous: torch's own answer (it raises)

    handler.guardrails_original = original  # type: ignore[attr-defined]
    return handler


@contextlib.contextmanager
def namespaced_rendezvous() -> Iterator[None]:
    """While inside, ``init_process_group`` (``env://``, ``tcp://``) under a
    single-agent torchrun connects through a store of this attempt's own; on leaving,
    torch's handlers are back, the very objects found. A no-op outside torchrun, and
    inside another ``namespaced_rendezvous`` (a decorated ``main`` run by
    ``python -m guardrails.run``: one prefix, not two).

    torch has a public ``register_rendezvous_handler`` but no way to replace or remove
    one (it raises on a scheme already registered), so the registry entry is taken out
    of ``torch.distributed.rendezvous._rendezvous_handlers`` first and put back after.
    """
    if number() is None:
        yield
        return
    # The module, not ``torch.distributed.rendezvous`` the function of the same name.
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    found = {
        scheme: handlers[scheme]
        for scheme in _SCHEMES
        if scheme in handlers and not hasattr(handlers[scheme], "guardrails_original")
    }
    for scheme, original in found.items():
        del handlers[scheme]
        dist.register_rendezvous_handler(scheme, _namespaced(original))
    try:
        yield
    finally:
        for scheme, original in found.items():
            handlers[scheme] = original
