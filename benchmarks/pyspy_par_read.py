"""py-spy on the marinfs daemon while 8 readers each read a different object, cold (bench.py's
par_read row, unmeasured): GIL-holding samples by frame, and the threads that built a botocore
client. Run as root from the repository root; SZ=MiB sets the total (default 64, 8 objects).

    SZ=64 python benchmarks/pyspy_par_read.py
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench as b  # noqa: E402

tmp = Path(tempfile.mkdtemp(prefix="marinfs-bench-spy-")); shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="marinfs-bench-"))
a = argparse.Namespace(size_mib=int(os.environ.get("SZ", "64")), marinfs_arg=[], latency_ms=0, randoms=10, faults=10)
s3 = b.servers.start_seaweedfs(tmp / "server")
try:
    env = b.Env(a, tmp, shm, s3, b.Results())
    env.admin = env.s3fs_client(s3.endpoint); env.fs = env.admin; env.store = env.obstore()
    d = b.prepare(env, {"par_read"})
    with b.mounted(env, "marinfs", "spy") as m:
        b.drop_caches()
        out = tmp / "spy.txt"
        rec = subprocess.Popen([shutil.which("py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}") or "py-spy", "record", "--pid", str(m.pid), "--format", "raw", "--gil",
                                "--nonblocking", "--threads", "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)
        w = b.CpuWatch(env.pids(m.pid)).start()
        b.run_dds([(m.path / "shards" / f"shard-{i}.bin", Path("/dev/null")) for i in range(8)], d.shard_size)
        secs, cpu = w.stop()
        rec.send_signal(2); rec.communicate(timeout=60)
        print("secs", secs, "cpu", cpu, "metrics", b.request_delta({}, b.metrics(m)))
    tot = 0; leaf = Counter(); incl = Counter()
    for line in out.read_text().splitlines():
        st, _, n = line.rpartition(" "); n = int(n); tot += n
        fr = st.split(";"); leaf[fr[-1]] += n
        for f in set(fr): incl[f.split(" (")[0]] += n
    print("GIL samples", tot)
    threads = Counter()
    for line in out.read_text().splitlines():
        st, _, n = line.rpartition(" ")
        if "create_client" in st:
            threads[st.split(";")[0]] += int(n)
    print("threads building a botocore client:", len(threads), dict(threads))
    for f, c in leaf.most_common(12): print(f"{100*c/tot:5.1f}% {f}")
    print("-- inclusive")
    for f, c in incl.most_common(30): print(f"{100*c/tot:5.1f}% {f}")
finally:
    s3.stop(); shutil.rmtree(tmp, ignore_errors=True); shutil.rmtree(shm, ignore_errors=True)
