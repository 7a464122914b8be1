"""The pace guard: where each rank's step time goes, stragglers, slowdowns and
communication-bound steps (``pace.py``), judged by plain functions (``judge.py``)."""
