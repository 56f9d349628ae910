"""Mooncake JSONL trace loading: the real traces' figures, every bad-input kind, gzip."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from pymooncake.workload import (
    Trace,
    TraceError,
    TraceRequest,
    bundled_trace_path,
    load_trace,
    trace_stats,
)

from .conftest import req, shared_trace

GOOD = req(0, 1000, 10, [1, 2])


class TestRealTraces:
    def test_bundled_conversation_figures(self, conversation: Trace) -> None:
        # issue #2 / shared/traces/README.md: 12,031 requests, mean input 12,035, output 343
        s = trace_stats(conversation)
        assert s.num_requests == 12_031
        assert round(s.mean_input_length) == 12_035
        assert round(s.mean_output_length) == 343
        assert s.num_skipped == 0
        assert 3500 < s.duration_s < 3600  # "~1 h"

    def test_shared_conversation_equals_bundled(self, conversation: Trace) -> None:
        shared = load_trace(shared_trace("conversation"))
        assert shared.requests == conversation.requests

    def test_shared_synthetic_figures(self) -> None:
        s = trace_stats(load_trace(shared_trace("synthetic")))
        assert (s.num_requests, round(s.mean_input_length), round(s.mean_output_length)) == \
            (3_993, 15_325, 149)
        assert 900 < s.duration_s < 1100  # "~17 min"

    def test_request_fields(self, conversation: Trace) -> None:
        first = conversation.requests[0]
        # first line of the file
        assert first == TraceRequest(0.0, 6758, 500, tuple(range(14)), index=0)
        assert [r.index for r in conversation.requests[:5]] == [0, 1, 2, 3, 4]
        assert isinstance(first.timestamp_ms, float)

    def test_bundled_path_unknown_name(self) -> None:
        with pytest.raises(FileNotFoundError, match="conversation"):
            bundled_trace_path("nope")


BAD_LINES = [
    ('{"timestamp": 0, "input_length": 5', "malformed JSON"),
    ("[1, 2, 3]", "expected a JSON object, got list"),
    ('"text"', "expected a JSON object, got str"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1}, "missing field 'hash_ids'"),
    ({"input_length": 5, "hash_ids": []}, "missing fields 'timestamp', 'output_length'"),
    (req(0, "5", 1, [1]), "input_length must be an int in [1, 2147483647], got '5'"),  # type: ignore[arg-type]
    (req(0, 5.0, 1, [1]), "input_length must be an int in [1, 2147483647], got 5.0"),  # type: ignore[arg-type]
    (req(0, True, 1, [1]), "input_length must be an int in [1, 2147483647], got True"),  # type: ignore[arg-type]
    (req(0, -5, 1, []), "input_length must be an int in [1, 2147483647], got -5"),
    (req(0, 0, 1, []), "input_length must be an int in [1, 2147483647], got 0"),
    (req(0, 5, -1, [1]), "output_length must be an int in [0, 2147483647], got -1"),
    (req(0, 5, 1.5, [1]), "output_length must be an int in [0, 2147483647], got 1.5"),  # type: ignore[arg-type]
    (req("0", 5, 1, [1]), "timestamp must be a finite number of ms, got '0'"),  # type: ignore[arg-type]
    (req(-1, 5, 1, [1]), "timestamp must be in [0, 1e+15] ms, got -1.0"),
    ('{"timestamp": NaN, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
     "timestamp must be a finite number"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "1,2"},
     "hash_ids must be a list of ints, got str"),
    (req(0, 5, 1, [1, "x"]), "hash_ids must be ints >= 0, got 'x'"),  # type: ignore[list-item]
    (req(0, 5, 1, [-3]), "hash_ids must be ints >= 0, got -3"),
    (req(0, 512, 1, [1, 2]),
     "hash_ids has 2 entries but input_length 512 allows at most 1 blocks of 512 tokens"),
    (req(0, 1025, 1, [1, 2, 3, 4]),
     "hash_ids has 4 entries but input_length 1025 allows at most 3"),
]


class TestBadInput:
    @pytest.mark.parametrize("bad,what", BAD_LINES)
    def test_bad_line_names_file_and_line(self, write_jsonl, bad: object, what: str) -> None:  # noqa: ANN001
        path = write_jsonl([GOOD, "", bad, GOOD])  # blank line 2 still counts: bad is line 3
        with pytest.raises(TraceError) as ei:
            load_trace(path)
        msg = str(ei.value)
        assert msg.startswith(f"{path}:3: "), msg
        assert what in msg, msg
        assert ei.value.line == 3 and ei.value.path == str(path)
        assert isinstance(ei.value, ValueError)

    def test_skip_invalid_counts(self, write_jsonl) -> None:  # noqa: ANN001
        lines = [GOOD] + [bad for bad, _ in BAD_LINES] + [req(5, 600, 1, [1, 9])]
        t = load_trace(write_jsonl(lines), skip_invalid=True)
        assert t.num_skipped == len(BAD_LINES)
        assert len(t) == 2 and [r.index for r in t] == [0, 1]
        assert t.requests[1].hash_ids == (1, 9)
        assert t.skipped_errors[0].endswith(":2: malformed JSON (Expecting ',' delimiter at "
                                            "column 36)")
        assert [e.split(":")[1] for e in t.skipped_errors] == \
            [str(i) for i in range(2, 2 + len(BAD_LINES))]

    def test_hash_ids_limit_follows_block_size(self, write_jsonl) -> None:  # noqa: ANN001
        p = write_jsonl([req(0, 32, 1, [1, 2])])
        assert load_trace(p, block_size=16).requests[0].hash_ids == (1, 2)
        with pytest.raises(TraceError, match="at most 1 blocks of 32 tokens"):
            load_trace(p, block_size=32)
        with pytest.raises(ValueError, match="block_size"):
            load_trace(p, block_size=0)

    def test_not_utf8(self, tmp_path: Path) -> None:
        p = tmp_path / "t.jsonl"
        p.write_bytes(b'{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}\n'
                      b'{"timestamp": 0, "input_\xff": 5}\n')
        with pytest.raises(TraceError, match=r"t\.jsonl:2: not UTF-8"):
            load_trace(p)

    def test_missing_file_and_directory(self, tmp_path: Path) -> None:
        with pytest.raises(TraceError, match="nope.jsonl: no such file"):
            load_trace(tmp_path / "nope.jsonl")
        with pytest.raises(TraceError, match="is a directory"):
            load_trace(tmp_path)

    def test_corrupt_gzip(self, tmp_path: Path) -> None:
        p = tmp_path / "t.jsonl.gz"
        p.write_bytes(b"\x1f\x8b not really gzip")
        with pytest.raises(TraceError, match=r"t\.jsonl\.gz:1: cannot read"):
            load_trace(p)
        good = gzip.compress(b'{"timestamp": 0, "input_length": 5, "output_length": 1, '
                             b'"hash_ids": [1]}\n' * 100)
        p.write_bytes(good[: len(good) // 2])  # truncated
        with pytest.raises(TraceError, match="cannot read"):
            load_trace(p)


class TestFormat:
    def test_gzip_equals_plain(self, write_jsonl, tmp_path: Path) -> None:  # noqa: ANN001
        plain = write_jsonl([GOOD, req(3.5, 700, 2, [1, 4])])
        gz = tmp_path / "t.jsonl.gz"
        gz.write_bytes(gzip.compress(plain.read_bytes()))
        assert load_trace(gz).requests == load_trace(plain).requests
        assert load_trace(plain).requests[1].timestamp_ms == 3.5

    def test_out_of_order_timestamps_sorted_stably(self, write_jsonl) -> None:  # noqa: ANN001
        t = load_trace(write_jsonl([req(20, 5, 1, [1]), req(10, 5, 1, [2]),
                                    req(20, 5, 1, [3]), req(0, 5, 1, [4])]))
        assert [r.hash_ids[0] for r in t] == [4, 2, 1, 3]
        assert [r.index for r in t] == [3, 1, 0, 2]  # file positions kept

    def test_extra_fields_ignored_blank_lines_skipped(self, write_jsonl) -> None:  # noqa: ANN001
        t = load_trace(write_jsonl(["", {**GOOD, "note": "x"}, "   ", GOOD, ""]))
        assert len(t) == 2 and t.num_skipped == 0

    def test_empty_file(self, write_jsonl) -> None:  # noqa: ANN001
        t = load_trace(write_jsonl([]))
        assert len(t) == 0 and trace_stats(t).num_requests == 0

    def test_trace_request_validation(self) -> None:
        with pytest.raises(ValueError, match="hash_ids must be a tuple"):
            TraceRequest(0.0, 5, 1, [1])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="index"):
            TraceRequest(0.0, 5, 1, (1,), index=-1)
        with pytest.raises(ValueError, match="finite"):
            TraceRequest(float("inf"), 5, 1, (1,))
        assert TraceRequest(1500.0, 5, 1, (1,)).timestamp_s == 1.5
