"""The engine client: what the gateway knows of the engine (EngineClient, OutputDelta) and
its ZeroMQ implementation. The bottom layer: it imports nothing else of the gateway."""
