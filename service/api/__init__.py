"""HTTP layer: the FastAPI app (``app.create_app``), its routes, wire codecs and the uvicorn runner."""
