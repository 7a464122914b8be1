"""Private: see ARCHITECTURE.md."""
