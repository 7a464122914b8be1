"""NanGuard: a non-finite step skipped on every rank and diagnosed; the spike rule and
the training-health checks beside it.
"""
