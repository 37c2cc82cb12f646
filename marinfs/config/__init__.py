"""Settings: the one table (its kinds and routes in settings.py, the mount's fields in mount.py)
feeding flags, `MARINFS_*` variables, the TOML file (file.py), fstab options and the docs."""
