"""The run's record on disk and elsewhere: ``metrics.parquet`` (schema, reader, hourly
merge), ``events.jsonl``, and the sinks (TensorBoard, W&B, MLflow). Private; the
readers are public as ``guardrails.iter_metrics`` / ``read_metrics``.
"""
