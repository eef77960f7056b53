"""The gRPC front end (shuttle.v1, proto/): servicers and proto <-> engine conversions, by
the HTTP API's rules and messages."""
