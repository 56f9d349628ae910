"""Roles started by hand on three "hosts" form one cluster (issue #6 Build item 5).

Each host is a Linux network namespace with its own address on a bridge and its own UTS
namespace (hostname), so the Transfer Engine sees different hosts and moves KV over TCP,
not shared memory: h1 runs the Store master and the Conductor, h2 a prefill worker, h3 a
prefill and a decode worker; a real etcd on the bridge is the metadata service. Checks:
P/D greedy output over the network equals one colocated engine's, and a prompt sharing a
prefix with one prefilled on the other host reuses it through the Store.

Needs root, ``ip``, ``unshare`` and ``etcd`` (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

NET = f"10.231.{20 + os.getpid() % 200}"
TAG = f"pmt{os.getpid() % 100000}"
CONTEXT = 2048


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no {tool}"
    if _etcd() is None:
        return "no etcd binary"
    r = subprocess.run(["ip", "netns", "add", f"{TAG}probe"], capture_output=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", f"{TAG}probe"], capture_output=True)
    return None


def _etcd() -> str | None:
    return shutil.which("etcd") or next(
        (p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if Path(p).exists()), None)


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def _ready(proc: subprocess.Popen, what: str, timeout_s: float = 60.0) -> dict:
    """The first JSON line a pymooncake role prints (``{"event": "ready", ...}``)."""
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    buf = b""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with status {proc.returncode}")
        chunk = proc.stdout.read() or b""
        buf += chunk
        for line in buf.splitlines():
            if line.startswith(b"{"):
                info = json.loads(line)
                if info.get("event") == "ready":
                    return info
        time.sleep(0.1)
    pytest.fail(f"{what} not ready in {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    why = _missing()
    if why:
        pytest.skip(why)
    bridge = f"{TAG}br"[:15]
    procs: list[subprocess.Popen] = []
    made: list[str] = []
    try:
        _sh("ip", "link", "add", bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{NET}.1/24", "dev", bridge)
        _sh("ip", "link", "set", bridge, "up")
        for i in (1, 2, 3):
            ns, veth = f"{TAG}h{i}", f"{TAG}v{i}"[:13]
            _sh("ip", "netns", "add", ns)
            made.append(ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "p")
            _sh("ip", "link", "set", veth + "p", "master", bridge)
            _sh("ip", "link", "set", veth + "p", "up")
            _sh("ip", "link", "set", veth, "netns", ns)
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{NET}.1{i}/24", "dev", veth)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", veth, "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        etcd_dir = tmp_path_factory.mktemp("etcd-mh")
        cu, pu = f"http://{NET}.1:2379", f"http://{NET}.1:2380"
        procs.append(subprocess.Popen(
            [str(_etcd()), "--name", "mh", "--data-dir", str(etcd_dir),
             "--listen-client-urls", cu, "--advertise-client-urls", cu,
             "--listen-peer-urls", pu, "--initial-advertise-peer-urls", pu,
             "--initial-cluster", f"mh={pu}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        md = f"etcd://{NET}.1:2379"
        env = dict(os.environ, PYTHONUNBUFFERED="1")

        def role(host: int, *argv: str) -> subprocess.Popen:
            inner = " ".join([sys.executable, "-m", "pymooncake", *argv])
            p = subprocess.Popen(
                ["ip", "netns", "exec", f"{TAG}h{host}", "unshare", "-u", "sh", "-c",
                 f"hostname {TAG}-host{host} && exec {inner}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
            procs.append(p)
            return p

        h1 = f"{NET}.11"
        master = _ready(role(1, "master", "--host", h1, "--port", "0"), "master")
        cond = _ready(role(1, "conductor", "--host", h1, "--port", "0", "--worker-port", "0",
                           "--policy", "round-robin", "--global-store", "--model", "tiny",
                           "--context-length", str(CONTEXT)), "conductor")
        common = ["--conductor", f"{h1}:{cond['worker_port']}", "--metadata", md,
                  "--model", "tiny", "--max-model-len", str(CONTEXT), "--num-kv-blocks", "512"]
        for host, name, kind in ((2, "prefill-a", "prefill"), (3, "prefill-b", "prefill"),
                                 (3, "decode-c", "decode")):
            extra = ["--master", f"{h1}:{master['port']}"] if kind == "prefill" else []
            _ready(role(host, kind, "--id", name, "--host", f"{NET}.1{host}", *extra,
                        *common), name)
        url = cond["url"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            h = subprocess.run(["ip", "netns", "exec", f"{TAG}h1", sys.executable, "-c",
                                f"import httpx; print(httpx.get('{url}/health').text)"],
                               capture_output=True, text=True)
            if h.returncode == 0 and len(json.loads(h.stdout).get("workers", [])) == 3:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the three workers did not register with the Conductor")
        yield {"url": url, "ns": f"{TAG}h1"}
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def _client_in(ns: str, code: str) -> dict:
    """Run ``code`` (which prints one JSON line) with Python inside namespace ``ns``."""
    r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_roles_on_three_hosts_serve_exact_output_and_reuse_across_hosts(hosts):
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    rng = random.Random(11)
    shared = [rng.randrange(256) for _ in range(160)]           # 10 full blocks
    prompts = [shared + [rng.randrange(256) for _ in range(9)] for _ in range(2)]
    ref = Engine.from_model_name("tiny", EngineConfig(max_model_len=CONTEXT)).generate(
        prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    code = f"""
import httpx, json, time
url = "{hosts['url']}"
def run(p):
    body = {{"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0,
             "ignore_eos": True, "stream": True, "return_token_ids": True,
             "stream_options": {{"include_usage": True}}}}
    ids, usage = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {{"):
                c = json.loads(line[6:])
                usage = c.get("usage") or usage
                for ch in c.get("choices", []):
                    ids += ch.get("token_ids") or []
    return [r.status_code, ids, usage]
out = [run({prompts[0]!r})]
deadline = time.monotonic() + 20      # Store puts are deferred and reported as KV events
while httpx.get(url + "/health").json()["num_store_blocks"] < 10:
    assert time.monotonic() < deadline, "the first prompt's blocks never reached the Store"
    time.sleep(0.2)
out.append(run({prompts[1]!r}))
deadline = time.monotonic() + 5       # load reports (prefill-token counters) lag ~0.1 s
while True:
    h = httpx.get(url + "/health").json()
    tokens = {{w["instance_id"]: w["num_prefill_tokens_total"] for w in h["workers"]}}
    if sum(tokens.values()) >= 178 or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print(json.dumps({{"out": out, "workers": tokens}}))
"""
    got = _client_in(hosts["ns"], code)
    (s1, ids1, u1), (s2, ids2, u2) = got["out"]
    assert (s1, s2) == (200, 200)
    assert ids1 == list(ref[0].output_token_ids)            # KV moved h2/h3 -> h3 over TCP
    assert ids2 == list(ref[1].output_token_ids)
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    # round-robin put the 2nd prompt on the other prefill worker (other host): its 10
    # shared blocks came from the Store, whose copy lives in the first worker's segment
    assert u2["prompt_tokens_details"]["cached_tokens"] == 160
    # prompt tokens the prefill workers computed: all 169 of the first prompt, 9 of the 2nd
    assert got["workers"]["prefill-a"] + got["workers"]["prefill-b"] == 169 + 9
