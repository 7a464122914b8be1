"""Rewind: back to an in-memory snapshot taken before a divergence or a streak of
non-finite steps, past the trouble's batches, and on (opt-in)."""
