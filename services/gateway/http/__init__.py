"""The HTTP front end (FastAPI): routes, the chat and completions response builders, SSE,
errors, admin routes, body limits, /metrics."""
