"""The package version, in one place (``remat.__version__``)."""

__version__ = "0.1.0"
