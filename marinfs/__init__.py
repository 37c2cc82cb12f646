"""marinfs: mount a Marin storage prefix (any fsspec URL) as a POSIX filesystem."""

__version__ = "0.1.0"
