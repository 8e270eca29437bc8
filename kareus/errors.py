"""The one error type that the CLI turns into a clean one-line message and a non-zero exit."""


class KareusError(RuntimeError):
    """A user-facing failure (bad table, infeasible plan request, refused resume): one clear line."""
