"""The core: the filesystem in plain Python, usable and tested without FUSE."""

from marinfs.core.filesystem import Filesystem
from marinfs.core.handles import Opened
from marinfs.core.paths import key_of

__all__ = ["Filesystem", "Opened", "key_of"]
