"""The one error of ``anyfit export``: an input or a result that stops the export, said in one line."""

from anyfit.config import ConfigError


class ExportError(ConfigError):
    """An export that cannot be done as asked; the message says why (printed as ``anyfit: error: ...``)."""
