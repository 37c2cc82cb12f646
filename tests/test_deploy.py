"""Containers and Kubernetes (docs/operations.md, deploy/): mount propagation between the host
and "containers" — new mount namespaces made by `unshare`, as a container runtime makes them —
and deploy/'s manifests against Kubernetes' schema.

- A workload started before the mount, with the host's shared directory bound `rslave`
  (`docker run -v /mnt/marin:/mnt/marin:rslave`, Kubernetes' `HostToContainer`), sees a mount
  made on the host after it started, and again after the daemon restarts.
- A daemon run inside a namespace that mounts onto a shared bind mount (the DaemonSet's
  `Bidirectional` hostPath) is seen on the host; SIGTERM to it commits the writes still open
  before it exits, and its unmount reaches the host.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mounting import force_unmount, subprocess_mount
import tiers

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
PROPAGATION = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"),
                                 reason="mount namespaces need root, unshare and nsenter (util-linux)")


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


def _wait(predicate, timeout: float = 30.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _gone(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    except OSError:
        return True


@pytest.fixture
@tiers.needs("mount")
def shared_dir(tmp_path: Path) -> Iterator[Path]:
    """The host's /mnt/marin: a directory that is a shared mount (a bind of itself), as on a
    node where systemd makes / shared. Mounts under it reach its peers and slaves."""
    path = tmp_path / "marin"
    path.mkdir()
    _run("mount", "--bind", str(path), str(path))
    try:
        _run("mount", "--make-shared", str(path))
        yield path
    finally:
        subprocess.run(["umount", "-R", "-l", str(path)], capture_output=True, timeout=30)


@contextlib.contextmanager
def container(host_dir: Path, inside: Path) -> Iterator[int]:
    """A "container": a new mount namespace whose mounts are slaves of the host's (`unshare
    --propagation slave`), with ``host_dir`` bound at ``inside`` and made `rslave` as `docker run
    -v HOST:INSIDE:rslave` and Kubernetes' `HostToContainer` do. Yields a PID in it (for
    `nsenter`); the namespace goes with that process."""
    inside.mkdir(parents=True, exist_ok=True)
    script = (f"mount --rbind '{host_dir}' '{inside}' && mount --make-rslave '{inside}' && echo ready "
              "&& exec sleep 600")
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "slave", "--", "sh", "-c", script],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.stderr.read()
        yield proc.pid
    finally:
        proc.kill()  # by its PID: the namespace and its mounts go with it
        proc.wait()


def in_container(pid: int, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", "-t", str(pid), "-m", "--", *command], capture_output=True, text=True,
                          timeout=60)


@PROPAGATION
@pytest.mark.mount
def test_a_container_sees_a_mount_made_after_it_started_and_after_a_restart(shared_dir: Path, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "f").write_text("from the bucket")
    mnt, cache = shared_dir / "data", tmp_path / "cache"
    mnt.mkdir()
    with container(shared_dir, tmp_path / "rootfs/mnt/marin") as pid:
        inside = tmp_path / "rootfs/mnt/marin/data"
        assert in_container(pid, "cat", str(inside / "f")).returncode != 0  # not mounted yet
        with subprocess_mount(str(remote), mnt, cache) as first:
            seen = in_container(pid, "cat", str(inside / "f"))
            assert seen.returncode == 0 and seen.stdout == "from the bucket", seen.stderr
            wrote = in_container(pid, "sh", "-c", f"echo from the container > '{inside}/g'")
            assert wrote.returncode == 0, wrote.stderr
            assert (remote / "g").read_text() == "from the container\n"  # committed at its close
        # The daemon restarts (a new DaemonSet pod, `systemctl restart`): the container sees the
        # mount go, then the new one, with no restart of its own.
        assert _wait(lambda: in_container(pid, "cat", str(inside / "f")).returncode != 0, 10)
        (remote / "f").write_text("after the restart")
        with subprocess_mount(str(remote), mnt, cache) as second:
            assert second != first
            seen = in_container(pid, "cat", str(inside / "f"))
            assert seen.returncode == 0 and seen.stdout == "after the restart", seen.stderr
            mounts = in_container(pid, "cat", "/proc/self/mounts").stdout
            assert mounts.count(f" {inside} fuse.marinfs ") == 1  # the new mount, no dead one left under it


@PROPAGATION
@pytest.mark.mount
def test_a_container_that_bound_the_mount_itself_keeps_the_old_daemon(tmp_path: Path) -> None:
    """What the docs warn of: `-v /mnt/marin/data:...` (the mount, not the directory above it)
    gives the container a copy of that mount. The host's unmount leaves the copy, so the daemon
    keeps serving it and does not exit (`marinfs umount` says so, exit 1); once the daemon is
    stopped the container gets ENOTCONN, and it never sees the next daemon's mount."""
    remote, mnt = tmp_path / "remote", tmp_path / "mnt"
    remote.mkdir()
    (remote / "f").write_text("hello")
    with subprocess_mount(str(remote), mnt, tmp_path / "cache") as pid:
        with container(mnt, tmp_path / "rootfs/data") as box:
            inside = tmp_path / "rootfs/data/f"
            assert in_container(box, "cat", str(inside)).stdout == "hello"
            stop = subprocess.run([sys.executable, "-m", "marinfs", "umount", str(mnt), "--timeout", "2"],
                                  capture_output=True, text=True, timeout=60)
            assert stop.returncode == 1 and "is unmounted but daemon" in stop.stderr and not os.path.ismount(mnt)
            assert in_container(box, "cat", str(inside)).stdout == "hello"  # still served, by the old daemon
            os.kill(pid, signal.SIGTERM)
            assert _wait(lambda: _gone(pid), 30)
            dead = in_container(box, "cat", str(inside))
            assert dead.returncode != 0 and "Transport endpoint is not connected" in dead.stderr


@PROPAGATION
@pytest.mark.mount
def test_a_daemon_in_a_container_mounts_for_the_host_and_drains_on_sigterm(shared_dir: Path, tmp_path: Path) -> None:
    """The DaemonSet: the daemon's container binds the host directory `Bidirectional`
    (rshared); its mount shows on the host. SIGTERM (the pod stops) commits a file a job on the
    host still has open, then the daemon exits and its unmount reaches the host."""
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "f").write_text("from the bucket")
    (shared_dir / "data").mkdir()
    inside = tmp_path / "rootfs/mnt/marin"
    inside.mkdir(parents=True)
    log = tmp_path / "daemon.log"
    script = (f"mount --bind '{shared_dir}' '{inside}' && mount --make-shared '{inside}' && exec "
              f"'{sys.executable}' -m marinfs mount '{remote}' '{inside}/data' --foreground "
              f"--cache-dir '{tmp_path / 'cache'}' --log-file '{log}'")
    daemon = subprocess.Popen(["unshare", "--mount", "--propagation", "unchanged", "--", "sh", "-c", script],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    host_mnt = shared_dir / "data"
    writer = None
    try:
        assert _wait(lambda: os.path.ismount(host_mnt) or daemon.poll() is not None), "the mount never showed"
        assert daemon.poll() is None, daemon.stderr.read() if daemon.stderr else ""
        assert (host_mnt / "f").read_text() == "from the bucket"  # the host reads through the pod's mount
        (host_mnt / "h").write_text("from the host")
        assert (remote / "h").read_text() == "from the host"
        code = (f"import sys, time\nf = open({str(host_mnt / 'log.bin')!r}, 'wb')\n"
                f"f.write(bytes(range(256)) * ({3 * MiB} // 256))\nf.flush()\nprint('written', flush=True)\n"
                "time.sleep(120)\n")
        writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert writer.stdout is not None and writer.stdout.readline().strip() == "written"
        assert not (remote / "log.bin").exists()  # still open: staged, not committed
        os.kill(daemon.pid, signal.SIGTERM)
        assert _wait(lambda: _gone(daemon.pid), 60)
        assert (remote / "log.bin").read_bytes() == bytes(range(256)) * (3 * MiB // 256)
        assert daemon.wait(10) == 0
        assert _wait(lambda: not os.path.ismount(host_mnt), 10)  # the pod's unmount reached the host
        assert "Traceback" not in log.read_text()
    finally:
        if writer is not None:
            writer.kill()
            writer.wait()
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        force_unmount(host_mnt)


# -- deploy/: the manifests and the image recipe -----------------------------------------------
DEPLOY = ROOT / "deploy"


def _documents() -> list[tuple[str, dict]]:
    import yaml

    return [(path.name, doc) for path in sorted(DEPLOY.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def _one(kind: str) -> dict:
    found = [doc for _, doc in _documents() if doc["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


def test_every_manifest_validates_against_the_current_kubernetes_schema() -> None:
    import kubernetes_validate

    docs = _documents()
    assert {d["kind"] for _, d in docs} >= {"DaemonSet", "ConfigMap", "Secret", "Pod"}
    version = kubernetes_validate.latest_version()
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)  # strict: no unknown field either
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {exc.message}", pytrace=False)


def test_the_configmaps_settings_pass_marinfs_config_check(tmp_path: Path) -> None:
    config = tmp_path / "marinfs.toml"
    config.write_text(_one("ConfigMap")["data"]["marinfs.toml"])
    check = subprocess.run([sys.executable, "-m", "marinfs", "config", "check", str(config)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr


def test_the_daemonset_and_the_workload_agree_on_the_mount() -> None:
    """What docs/operations.md promises of them: a privileged pod with /dev/fuse, the host
    directory Bidirectional, the FUSE mount one level under it (so the workload, binding the
    directory HostToContainer, sees every new mount of a restarted daemon), a readiness probe
    on `marinfs status`, a preStop that unmounts and waits, credentials from the Secret."""
    import tomllib

    settings = tomllib.loads(_one("ConfigMap")["data"]["marinfs.toml"])
    mountpoint = Path(settings["mountpoint"])
    spec = _one("DaemonSet")["spec"]["template"]["spec"]
    (box,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in box["volumeMounts"]}
    assert box["securityContext"]["privileged"] is True
    assert volumes[mounts["/dev/fuse"]["name"]]["hostPath"]["type"] == "CharDevice"
    shared = mounts[str(mountpoint.parent)]
    assert shared["mountPropagation"] == "Bidirectional"
    assert volumes[shared["name"]]["hostPath"]["path"] == str(mountpoint.parent)
    assert volumes[mounts[str(Path(settings["cache_dir"]).parent)]["name"]]["hostPath"]
    assert box["readinessProbe"]["exec"]["command"] == ["marinfs", "status", str(mountpoint)]
    stop = " ".join(box["lifecycle"]["preStop"]["exec"]["command"])
    assert f"marinfs umount {mountpoint}" in stop
    assert settings["drain_timeout"] < spec["terminationGracePeriodSeconds"]
    assert box["envFrom"][0]["secretRef"]["name"] == _one("Secret")["metadata"]["name"]
    config_volume = next(v for v in spec["volumes"] if "configMap" in v)
    assert mounts["/etc/marinfs"]["name"] == config_volume["name"]
    pod = _one("Pod")["spec"]
    (bind,) = pod["containers"][0]["volumeMounts"]
    assert bind["mountPropagation"] == "HostToContainer" and bind["mountPath"] == str(mountpoint.parent)
    assert pod["volumes"][0]["hostPath"]["path"] == str(mountpoint.parent)


def test_the_image_recipe_copies_what_exists() -> None:
    recipe = (DEPLOY / "Dockerfile").read_text()
    for line in recipe.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
    assert "fuse3" in recipe and "marinfs.toml" in recipe
