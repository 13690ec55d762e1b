"""Generated gRPC modules for proto/omni/v1 (regenerate: python -m omni._proto.build)."""
