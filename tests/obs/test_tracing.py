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


def test_explicit_root_span_groups_one_request_across_awaits(exported):
    """The Conductor's request span: opened at arrival, stages recorded under it from
    anywhere (no current-span context needed), closed at the end; two requests are two
    traces."""
    roots = [tracing.start_root_span("serving.request", 100.0 + i, request_id=f"r{i}")
             for i in range(2)]
    tracing.record_span("serving.queue", 100.0, 100.25, parent=roots[0])
    tracing.record_span("serving.prefill", 101.0, 101.5, parent=roots[1])
    with tracing.span("unrelated"):
        tracing.record_span("serving.decode", 100.5, 101.0, parent=roots[0])
    for i, r in enumerate(roots):
        tracing.end_span(r, 102.0 + i)
    by = {s.name: s for s in exported.get_finished_spans()}
    r0 = next(s for s in exported.get_finished_spans()
              if s.name == "serving.request" and s.attributes["request_id"] == "r0")
    r1 = next(s for s in exported.get_finished_spans()
              if s.name == "serving.request" and s.attributes["request_id"] == "r1")
    assert r0.start_time == 100 * 10**9 and r0.end_time == 102 * 10**9 and r0.parent is None
    for name, root in (("serving.queue", r0), ("serving.decode", r0), ("serving.prefill", r1)):
        assert by[name].parent.span_id == root.context.span_id
        assert by[name].context.trace_id == root.context.trace_id
    assert r0.context.trace_id != r1.context.trace_id


def test_root_span_helpers_are_no_ops_while_off():
    tracing.shutdown_tracing()
    h = tracing.start_root_span("serving.request", 1.0)
    assert h is None
    tracing.record_span("x", 1.0, 2.0, parent=h)
    tracing.end_span(h, 3.0)


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


def test_otlp_exporter_posts_to_the_standard_endpoint(monkeypatch):
    """A real OTLP/HTTP export to a loopback collector, decoded with opentelemetry-proto."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    received: list[tuple[str, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{srv.server_port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "5")
        tracing.configure_tracing("otlp", "pymooncake-conductor")
        assert tracing.tracing_enabled()
        tracing.record_span("p2d_transfer", 1_700_000_000.5, 1_700_000_000.75, num_blocks=4)
        tracing.shutdown_tracing()  # flushes the batch processor: one POST
    finally:
        tracing.shutdown_tracing()
        srv.shutdown()
        srv.server_close()
    assert [path for path, _ in received] == ["/v1/traces"]
    req = ExportTraceServiceRequest.FromString(received[0][1])
    (rs,) = req.resource_spans
    assert {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"] == (
        "pymooncake-conductor")
    (sp,) = [s for ss in rs.scope_spans for s in ss.spans]
    assert sp.name == "p2d_transfer"
    assert sp.start_time_unix_nano == 1_700_000_000_500_000_000
    assert sp.end_time_unix_nano == 1_700_000_000_750_000_000
    assert {a.key: a.value.int_value for a in sp.attributes} == {"num_blocks": 4}


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


def test_cli_env_default_is_validated_with_a_one_line_error():
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYMOONCAKE_OTEL="jaeger")
    out = subprocess.run([sys.executable, "-m", "pymooncake", "conductor", "--port", "0",
                          "--worker-port", "0"], capture_output=True, text=True, timeout=60,
                         env=env, check=False)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "PYMOONCAKE_OTEL" in out.stderr
    assert "console, otlp" in out.stderr
