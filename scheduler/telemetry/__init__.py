"""Telemetry every carpool process shares: OpenTelemetry set-up (``otel``), the metric names and
attributes (``metric_schema``), JSON log lines (``log_format``), process gauges (``process_metrics``)
and the lane-depth poller behind the queue gauges (``stream_stats``)."""
