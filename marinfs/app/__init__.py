"""The programs: the daemon, the CLIs (marinfs, mount.marinfs, status, cache), metrics and
systemd notification."""
