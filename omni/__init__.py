"""omni: a Ray-free distributed stage runtime for multi-stage model serving."""


def version() -> str:
    """The installed package's version (pyproject.toml), as /version and `omni --version` say it."""
    import importlib.metadata

    try:
        return importlib.metadata.version("omni")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"
