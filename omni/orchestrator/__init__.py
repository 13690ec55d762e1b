"""Per-frontend orchestrator: routes a request through the pipeline's stages."""
