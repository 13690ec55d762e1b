"""The omni master: registry, gRPC server and clients, `omni master` / `omni status`."""

DEFAULT_PORT = 50051
