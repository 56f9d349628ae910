"""What the mb/ scripts share: the bench's cluster arguments and the per-process dumps."""
import argparse, json, os


def bench_args(limit=300, pace=None):
    """bench serving's defaults (tiny model, 2 prefill + 1 decode, length scale 32)."""
    return argparse.Namespace(
        prefill=2, decode=1, global_segment_size=512 << 20, ttft_slo=5.0, tbt_slo=0.5,
        model="tiny", limit=limit, time_scale=1.0, length_scale=32,
        decode_step_interval_s=float(os.environ.get("PACE", "0")) if pace is None else pace)


def snap(cluster):
    """{process name: its sitecustomize dump} (processes without a dump are left out)."""
    out = {}
    for name, pid in cluster.pids().items():
        try:
            with open(f"/tmp/s37/steps/{pid}.json") as fh:
                out[name] = json.load(fh)
        except (OSError, ValueError):
            pass
    return out
