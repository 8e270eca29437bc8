"""What the CLI turns into a clean stop: a one-line message (or none) and a non-zero exit."""


class KareusError(RuntimeError):
    """A user-facing failure (bad table, infeasible plan request, refused resume): one clear line."""


class RefusedWithOutputs(KareusError):
    """Refused once the run's outputs are on disk (no plan meets the request): the run folder keeps
    the config Hydra saved for them, even where it held an earlier run."""


class JobRefused:
    """What a sweep job refused at run time returns (it printed its one line): the sweep goes on, the
    sweep's MLflow run counts the job as failed, and the command exits 2 once every job has run."""

    def __init__(self, job: str) -> None:
        self.job = job


class OutputClosed(BrokenPipeError):
    """The reader of the results (``| head``) left: the run stops as a shell tool does. Raised by the
    run's console only, so a broken socket elsewhere (an MLflow server, a Ray peer) is not taken for it."""


def not_text(err: UnicodeDecodeError) -> str:
    """How a file that is not UTF-8 text is named in an error line: where its first bad byte sits."""
    return f"not UTF-8 text (byte 0x{err.object[err.start]:02x} at {err.start})"
