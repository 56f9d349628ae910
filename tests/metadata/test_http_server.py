"""The HTTP metadata server speaks Mooncake's protocol and survives malformed requests."""

from __future__ import annotations

import httpx


def test_mooncake_wire_protocol_and_bad_requests(http_metadata_url: str) -> None:
    base = http_metadata_url.rsplit("/metadata", 1)[0]
    with httpx.Client(base_url=base, timeout=5) as c:
        # Mooncake's GET/PUT/DELETE /metadata?key=...
        assert c.get("/metadata", params={"key": "mooncake/ram/x"}).status_code == 404
        assert c.put("/metadata", params={"key": "mooncake/ram/x"},
                     content=b'{"name":"x"}').status_code == 200
        r = c.get("/metadata", params={"key": "mooncake/ram/x"})
        assert (r.status_code, r.content) == (200, b'{"name":"x"}')
        # A second PUT of an rpc_meta key is refused with 400, as Mooncake does.
        key = {"key": "mooncake/rpc_meta/x"}
        assert c.put("/metadata", params=key, content=b"a").status_code == 200
        assert c.put("/metadata", params=key, content=b"b").status_code == 400
        assert c.get("/metadata", params=key).content == b"a"
        # Malformed requests get a clear 4xx and the server keeps serving.
        assert c.put("/metadata", content=b"v").status_code == 400  # no key
        bad = c.put("/metadata", params={"key": "k", "lease_id": "abc"}, content=b"v")
        assert bad.status_code == 400 and "bad request" in bad.text
        assert c.post("/lease", params={"ttl_s": "-1"}).status_code == 400
        assert c.post("/lease/keepalive", params={"lease_id": "999999"}).status_code == 404
        assert c.get("/nope").status_code == 404
        assert c.delete("/metadata", params={"key": "mooncake/ram/x"}).status_code == 200
        assert c.delete("/metadata", params={"key": "mooncake/ram/x"}).status_code == 404
        assert c.get("/health").text == "ok"
