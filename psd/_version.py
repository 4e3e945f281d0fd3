"""psd's version, in a module of its own: psd.errors names it without importing the package."""

__version__ = "0.1.0"
