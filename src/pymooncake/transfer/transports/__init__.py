"""Transports of the Transfer Engine: local (memcpy), shm (peer-mapped shared memory), tcp."""
