"""The one error a user sees when a model cannot be loaded: it names the file and the reason."""
from pathlib import Path


class ModelLoadError(Exception):
    def __init__(self, path: Path | str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason
