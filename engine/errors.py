"""Typed errors the engine raises. The service maps each to a status code."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ValidationError(EngineError, ValueError):
    """A request or config value is invalid. `field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def __reduce__(self):  # pickles (it crosses from the engine process) with both arguments
        return type(self), (self.field, self.message)


class DuplicateRequest(ValidationError):
    """A request with this id is already running: an id names one live request at a time.
    The doors answer it apart from other invalid values (gRPC ALREADY_EXISTS)."""


class EngineOverloaded(EngineError):
    """A bounded resource is full (the request queue, the grammar compiler's threads); retry
    later."""


class ModelLoadError(EngineError):
    """A model could not be found, parsed, or matched to its weights."""
