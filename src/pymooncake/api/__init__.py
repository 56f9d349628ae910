"""The front door: OpenAI-compatible HTTP API over the Conductor (DESIGN.md §1).

``api.server.create_app(backend, codec, config)`` builds the FastAPI app; ``backend`` is
anything with ``generate(GenerateRequest) -> AsyncIterator[TokenEvent]`` (the live
Conductor), ``codec`` anything with ``encode``/``decode``/``apply_chat_template`` (the
model's tokenizer). The web framework appears only in this package.
"""
