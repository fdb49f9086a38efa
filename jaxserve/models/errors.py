"""The one error a user sees when a model cannot be loaded: it names the file and the reason."""
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class ModelLoadError(Exception):
    def __init__(self, path: Path | str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason

    def __reduce__(self):   # pickled whole: an engine process sends it to the server's
        return type(self), (self.path, self.reason)


@contextmanager
def blamed_on(path: Path | str) -> Iterator[None]:
    """Turn what a malformed config raises while it is read (a ValueError naming the field, or a KeyError or
    TypeError from a value of the wrong shape) into a ModelLoadError naming its file."""
    try:
        yield
    except ValueError as e:
        raise ModelLoadError(path, str(e)) from e
    except (KeyError, TypeError) as e:
        raise ModelLoadError(path, f"unusable value ({type(e).__name__}: {e})") from e
