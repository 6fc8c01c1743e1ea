"""voxpipe: a Qwen3-Omni-class speech agent served as three gRPC stage services behind a gateway."""

import sys


def version() -> str:
    """The installed voxpipe's version ("unknown" in a source tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed("voxpipe")
    except PackageNotFoundError:
        return "unknown"


def module_command(module: str) -> list[str]:
    """argv for `python -m module` in this interpreter, with -P: the working directory is not put on
    sys.path, so a child started in a source checkout imports the installed packages, not the checkout's
    top-level folders (its kernels/ would shadow Hugging Face's `kernels`, which transformers imports)."""
    return [sys.executable, "-P", "-m", module]
