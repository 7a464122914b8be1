"""The step engine: ``Guard`` (hooks, the step boundary, services), the state it
publishes, the component protocol, the data position, the grad norm, where a thread
is, how a failing process ends. It imports no guard. Private; ``Guard``,
``Component`` and ``record`` are public in ``guardrails``.
"""
