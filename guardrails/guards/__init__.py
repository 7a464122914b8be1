"""The guards, one module or folder each, each a ``Component``: NaN, memory, watchdog,
collective audit, preflight, checkpointer, GC, telemetry, error explanations,
GuardedDDP. A guard imports the engine and the layers below, never another guard
(two stated exceptions in ARCHITECTURE.md). Private; the classes are public in
``guardrails``.
"""
