#!/usr/bin/env python3
"""Download a file of the Debian archive's pool from the mirrors this machine's apt uses.

    fetch_from_apt_mirror.py POOL_PATH SHA256 OUT

``make libfuse`` takes libfuse's source this way: a site behind its own Debian mirror or proxy
gets it from there, and no host name is written into the repository. The mirrors are the URIs of
apt's enabled sources (``sources.list`` one-line entries and ``.sources`` deb822 stanzas, where
``apt-config`` says they are), tried in order; apt's ``Acquire::http(s)::Proxy`` is used. The
first answer whose SHA-256 is SHA256 is written to OUT; a wrong checksum is never written.
Failure: one line on stderr, exit 1.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

SCHEMES = ("http://", "https://", "file:")


def apt_config() -> dict[str, str]:
    """``apt-config shell``'s answers for where the sources are and the proxies (empty where
    apt-config is missing: the defaults below)."""
    wanted = {"SOURCELIST": "Dir::Etc::sourcelist/f", "SOURCEPARTS": "Dir::Etc::sourceparts/d",
              "HTTP_PROXY": "Acquire::http::Proxy", "HTTPS_PROXY": "Acquire::https::Proxy"}
    args = ["apt-config", "shell"] + [x for kv in wanted.items() for x in kv]
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found = {}
    for line in out.splitlines():
        name, _, value = line.partition("=")
        words = shlex.split(value) if value else []
        if words:
            found[name] = words[0]
    return found


def one_line_uris(text: str) -> list[str]:
    """URIs of ``deb``/``deb-src`` lines of a sources.list: ``deb [opts] URI suite comps``."""
    uris = []
    for line in text.splitlines():
        line = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
        if len(line) >= 2 and line[0] in ("deb", "deb-src"):
            uris.append(line[1])
    return uris


def deb822_uris(text: str) -> list[str]:
    """URIs of the enabled stanzas of a ``.sources`` file."""
    uris = []
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = None
        for line in stanza.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line[0].isspace() and key:
                fields[key] += " " + line.strip()
                continue
            key, _, value = line.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()
        if fields.get("enabled", "yes").lower() == "no" or not fields.get("types"):
            continue
        uris += fields.get("uris", "").split()
    return uris


def mirrors(sourcelist: Path, sourceparts: Path) -> list[str]:
    """Every URI apt would use, in apt's order (sources.list, then the parts by name), once."""
    uris: list[str] = []
    if sourcelist.is_file():
        uris += one_line_uris(sourcelist.read_text(errors="replace"))
    if sourceparts.is_dir():
        for part in sorted(sourceparts.iterdir()):  # apt reads only these two suffixes
            if part.suffix == ".list":
                uris += one_line_uris(part.read_text(errors="replace"))
            elif part.suffix == ".sources":
                uris += deb822_uris(part.read_text(errors="replace"))
    seen: list[str] = []
    for uri in uris:
        uri = uri.rstrip("/")
        if uri.startswith(SCHEMES) and uri not in seen:
            seen.append(uri)
    return seen


def fetch(uris: list[str], pool_path: str, sha256: str, out: Path,
          proxies: dict[str, str] | None = None, timeout: float = 60) -> str:
    """Write the first answer whose SHA-256 matches to ``out``; returns the URL it came from.
    No ``proxies``: the environment's (``http_proxy``...), as urllib takes them."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler(proxies or None))
    tried = []
    for uri in uris:
        url = f"{uri}/{pool_path.lstrip('/')}"
        digest = hashlib.sha256()
        try:
            with opener.open(url, timeout=timeout) as answer, \
                    tempfile.NamedTemporaryFile(dir=out.parent, delete=False) as tmp:
                for block in iter(lambda: answer.read(1 << 20), b""):
                    digest.update(block)
                    tmp.write(block)
        except OSError as exc:
            tried.append(f"{url}: {getattr(exc, 'reason', None) or exc}")
            continue
        if digest.hexdigest() != sha256:
            os.unlink(tmp.name)
            tried.append(f"{url}: SHA-256 {digest.hexdigest()}, not {sha256}")
            continue
        os.replace(tmp.name, out)
        return url
    raise LookupError("; ".join(tried) or "apt has no http, https or file source")


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: fetch_from_apt_mirror.py POOL_PATH SHA256 OUT", file=sys.stderr)
        return 2
    pool_path, sha256, out = argv
    config = apt_config()
    uris = mirrors(Path(config.get("SOURCELIST", "/etc/apt/sources.list")),
                   Path(config.get("SOURCEPARTS", "/etc/apt/sources.list.d")))
    proxies = {scheme: config[name] for scheme, name in (("http", "HTTP_PROXY"), ("https", "HTTPS_PROXY"))
               if config.get(name) and config[name] != "DIRECT"}
    try:
        url = fetch(uris, pool_path, sha256, Path(out), proxies)
    except LookupError as exc:
        print(f"fetch_from_apt_mirror: no apt mirror gave {pool_path} with its SHA-256 ({exc})", file=sys.stderr)
        return 1
    print(f"fetched {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
