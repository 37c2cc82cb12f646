"""The FUSE adapter: libfuse's calls, through mfusepy on libfuse 3, turned into the core's."""
