"""The one preflight check that needs no other rank: a CPU run computing in bfloat16
on a CPU without native bf16 instructions (no ``avx512_bf16`` / ``amx_bf16``), where
every bf16 op is emulated through float32. Typically the dtype was picked from
``torch.cuda.is_available()`` on a machine that has a GPU, for a run on its CPU.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

logger = logging.getLogger("guardrails.preflight")


def _warn_bf16_on_cpu(guard: Guard) -> None:
    """Warn when a CPU run computes in bf16 on a CPU without native bf16: emulated, it is
    many times slower than float32."""
    if guard.device.type != "cpu":
        return
    bf16 = any(p.dtype == torch.bfloat16 for p in guard.model.parameters())
    with contextlib.suppress(TypeError, RuntimeError):  # torch without per-device autocast
        bf16 = bf16 or (
            torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        )
    if not bf16:
        return
    from guardrails.util.probes import cpu_info

    try:
        native = cpu_info().get("bf16_native")
    except Exception:
        return
    if native is False:
        guard.event(
            "bf16_on_cpu",
            level="warning",
            message=(
                "the compute dtype is bfloat16 on a CPU without native bf16 (no avx512_bf16 "
                "/ amx_bf16): bf16 math is emulated through float32 and can be many times "
                "slower. Train CPU runs in float32, and pick the dtype from the device you "
                "train on, not from torch.cuda.is_available() (True on any machine with a "
                "GPU, also for a run on its CPU)."
            ),
        )
