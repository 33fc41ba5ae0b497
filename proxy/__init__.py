"""HyperHarness proxy: an OpenAI-compatible front for vLLM that keeps token-exact session transcripts.

Nothing happens at import; `proxy.app.create_app(settings)` builds the ASGI app and `python -m proxy`
runs it. The core (transcripts, stores, chat pipeline, upstream client) never imports FastAPI.
"""
