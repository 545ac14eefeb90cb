"""The OpenAI-compatible HTTP server: `build_app(engine)` and `run_server(args)` in api_server."""
