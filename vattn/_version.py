"""vattn's version: a leaf module, so that any module can name the version without a cycle."""

__version__ = "0.1.0"
