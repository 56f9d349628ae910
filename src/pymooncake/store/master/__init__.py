"""The store master: pure cores (objects, allocator, eviction, leases, core) under an asyncio
service (``service.py``)."""
