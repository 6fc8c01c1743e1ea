"""voxpipe: a Qwen3-Omni-class speech agent served as three gRPC stage services behind a gateway."""


def version() -> str:
    """The installed voxpipe's version ("unknown" in a source tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed("voxpipe")
    except PackageNotFoundError:
        return "unknown"
