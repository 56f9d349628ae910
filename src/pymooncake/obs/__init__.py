"""Observability: one Prometheus registry (``obs.metrics``), spans (``obs.tracing``),
logging (``obs.logging``) and SLO arithmetic (``obs.slo``)."""
