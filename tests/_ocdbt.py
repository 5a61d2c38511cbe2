"""Where a saved step keeps its arrays' chunks, read from the OCDBT database orbax reads.

A step's data files also hold B-tree nodes of earlier commits that no read reaches, so
damage aimed at "the middle of a file" can miss everything a restore reads. Tests that
damage array data aim at a chunk listed here instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import tensorstore as ts


class Chunk(NamedTuple):
  """One array chunk stored out of line: its key and where its bytes lie."""

  key: str
  path: Path
  offset: int
  length: int


def array_chunks(step_dir: Path) -> list[Chunk]:
  """The chunks the newest commit of a step's database stores in data files, largest first."""
  root = Path(step_dir) / "default"
  kvstore = ts.KvStore.open(f"file://{root}/").result()
  manifest = ts.ocdbt.dump(kvstore).result()
  pending = [manifest["versions"][-1]["root"]["location"]]
  chunks = []
  while pending:
    for entry in ts.ocdbt.dump(kvstore, pending.pop()).result()["entries"]:
      if "node" in entry:
        pending.append(entry["node"]["location"])
      elif "indirect_value" in entry:
        # "value:<base path>:<path in base>:<offset>:<length>"
        _, base, relative, offset, length = entry["indirect_value"].split(":")
        path = root / base / relative
        chunks.append(Chunk(entry["key"].decode(), path, int(offset), int(length)))
  return sorted(chunks, key=lambda chunk: (-chunk.length, chunk.key))


def flip_bytes(step_dir: Path, count: int) -> None:
  """Inverts ``count`` bytes in the middle of a step's largest array chunk."""
  chunk = array_chunks(step_dir)[0]
  with open(chunk.path, "r+b") as f:
    f.seek(chunk.offset + chunk.length // 2)
    data = f.read(count)
    f.seek(-len(data), os.SEEK_CUR)
    f.write(bytes(b ^ 0xFF for b in data))
