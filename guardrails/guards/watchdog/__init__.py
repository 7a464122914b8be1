"""Watchdog: hangs, dead ranks and uneven data as errors naming the rank."""
