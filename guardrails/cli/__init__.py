"""``python -m guardrails COMMAND``: one module per command (``report`` and
``inspect`` import no torch). Private.
"""
