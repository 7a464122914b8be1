"""Preflight: what must match across ranks, compared once before the first step."""
