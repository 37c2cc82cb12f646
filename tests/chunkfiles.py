"""Where a chunk cache keeps a chunk's bytes (marinfs/read/chunkcache.py's layout), for tests that
damage them: a chunk is recorded by a file under ``chunks/`` and held at an offset of its
version's data file under ``data/`` (or, from older daemons, by a file of its own)."""

from __future__ import annotations

from pathlib import Path


def records(cache_dir: Path, index: int | None = None) -> list[Path]:
    """The records of the chunks under ``cache_dir`` (of chunk ``index`` only, if given)."""
    pattern = "*-*-*" if index is None else f"*-{index}-*"
    return sorted(p for p in (cache_dir / "chunks").glob(f"*/{pattern}") if not p.name.startswith("tmp"))


def region(record: Path) -> tuple[Path, int, int]:
    """(file, offset, size) holding the bytes of the chunk ``record`` stands for."""
    object_id, _, rest = record.name.rsplit("-", 2)
    _, _, place = rest.partition("+")
    if not place:
        return record, 0, record.stat().st_size
    offset, size = (int(v) for v in place.split("+"))
    return record.parent.parent.parent / "data" / object_id[:2] / object_id, offset, size


def read_chunk(record: Path) -> bytes:
    path, offset, size = region(record)
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def flip_byte(record: Path, at: int = 0) -> None:
    """Damage one byte of the chunk, in place, as a failing disk would."""
    path, offset, _ = region(record)
    with open(path, "r+b") as f:
        f.seek(offset + at)
        byte = f.read(1)
        f.seek(offset + at)
        f.write(bytes([byte[0] ^ 0xFF]))


def cut_short(record: Path, keep: int) -> None:
    """Cut the chunk's file after ``keep`` of its bytes (and so every chunk after it)."""
    path, offset, _ = region(record)
    with open(path, "r+b") as f:
        f.truncate(offset + keep)


def chunk_gone(record: Path) -> bool:
    """The chunk is no longer recorded (its bytes freed with it)."""
    return not record.exists()
