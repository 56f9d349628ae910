"""obs.tracing: configure_tracing / record_span / span / shutdown_tracing (serving issue
item 7), checked against OpenTelemetry's in-memory exporter."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pymooncake.obs import tracing


@pytest.fixture
def exported():
    exp = InMemorySpanExporter()
    tracing.configure_tracing(None, "pymooncake-test", span_exporter=exp)
    try:
        yield exp
    finally:
        tracing.shutdown_tracing()


def test_record_span_times_and_attributes(exported):
    # 0.25 and 0.75 are exact in binary: the ns values follow by hand.
    tracing.record_span("prefill", 1_700_000_000.25, 1_700_000_001.75, worker="prefill-0",
                        num_tokens=512, cached=None)
    (s,) = exported.get_finished_spans()
    assert s.name == "prefill"
    assert s.start_time == 1_700_000_000_250_000_000
    assert s.end_time == 1_700_000_001_750_000_000
    assert dict(s.attributes) == {"worker": "prefill-0", "num_tokens": 512}
    assert s.parent is None
    assert s.resource.attributes["service.name"] == "pymooncake-test"


def test_record_span_is_child_of_current_span(exported):
    with tracing.span("request", request_id="r1"):
        tracing.record_span("p2d_transfer", 10.0, 10.5)
        tracing.record_span("decode", 10.5, 12.0)
    by_name = {s.name: s for s in exported.get_finished_spans()}
    assert set(by_name) == {"request", "p2d_transfer", "decode"}
    root = by_name["request"]
    assert dict(root.attributes) == {"request_id": "r1"}
    for child in ("p2d_transfer", "decode"):
        c = by_name[child]
        assert c.parent is not None
        assert c.parent.span_id == root.context.span_id
        assert c.context.trace_id == root.context.trace_id


def test_record_span_reversed_times_give_zero_length(exported):
    tracing.record_span("decode_load", 5.5, 5.0)
    (s,) = exported.get_finished_spans()
    assert s.start_time == s.end_time == 5_500_000_000


def test_record_span_rejects_non_finite(exported):
    with pytest.raises(ValueError, match="finite"):
        tracing.record_span("x", float("nan"), 1.0)


def test_off_by_default_and_after_shutdown_exports_nothing():
    exp = InMemorySpanExporter()
    tracing.configure_tracing(None, "t", span_exporter=exp)
    tracing.shutdown_tracing()
    assert not tracing.tracing_enabled()
    tracing.record_span("x", 1.0, 2.0)  # off: returns without checking anything
    tracing.record_span("x", float("nan"), 1.0)
    with tracing.span("y", a=1):
        pass
    assert exp.get_finished_spans() == ()
    tracing.shutdown_tracing()  # twice is fine
    tracing.configure_tracing(None, "t")
    tracing.configure_tracing("", "t")
    assert not tracing.tracing_enabled()


def test_bad_exporter_name_names_the_allowed_values():
    with pytest.raises(ValueError, match="console, otlp"):
        tracing.configure_tracing("jaeger", "t")
    assert not tracing.tracing_enabled()


def test_console_exporter_writes_to_stderr_not_stdout(capsys):
    tracing.configure_tracing("console", "pymooncake-test")
    try:
        assert tracing.tracing_enabled()
        tracing.record_span("tokenize", 1.0, 1.5, num_tokens=3)
    finally:
        tracing.shutdown_tracing()  # flushes the batch processor
    out, err = capsys.readouterr()
    assert out == ""
    assert '"name": "tokenize"' in err
    assert "pymooncake-test" in err


def test_otlp_exporter_configures(monkeypatch):
    # Nothing listens there; the span is dropped at export time, not at configuration.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    tracing.configure_tracing("otlp", "t")
    try:
        assert tracing.tracing_enabled()
    finally:
        tracing.shutdown_tracing()


@pytest.mark.parametrize(("exporter", "missing", "package"), [
    ("console", "opentelemetry.sdk.trace", "opentelemetry-sdk"),
    ("otlp", "opentelemetry.exporter.otlp.proto.http.trace_exporter",
     "opentelemetry-exporter-otlp-proto-http"),
])
def test_missing_package_is_named(monkeypatch, exporter, missing, package):
    monkeypatch.setitem(__import__("sys").modules, missing, None)  # import raises ImportError
    with pytest.raises(RuntimeError, match=f"pip install {package}"):
        tracing.configure_tracing(exporter, "t")
    assert not tracing.tracing_enabled()
