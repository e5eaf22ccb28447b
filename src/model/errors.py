"""Errors raised while loading a model: each names the file and the piece at fault."""


class ModelLoadError(Exception):
    """A model file or directory cannot be loaded (missing file, corrupt data)."""


class UnsupportedModelError(ModelLoadError):
    """The model uses an architecture, tensor type or option slotserve does not implement."""
