"""Skip markers for optional packages: a package counts as present only if it imports (one
found on the path whose own dependencies are missing, as a wheel installed with --no-deps can
be, gets the test skipped with the import's error instead of failing it)."""

import importlib

import pytest


def import_error(module: str) -> str | None:
    """Why `import module` fails, or None where it imports."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


_WANDB_ERROR = import_error("wandb")
needs_wandb = pytest.mark.skipif(
    _WANDB_ERROR is not None,
    reason=f"wandb does not import ({_WANDB_ERROR}); it is in the [test] extra")
