"""Reading a checkpoint's array headers (shapes and dtypes), not its data.

`open_stored` gives the shape and dtype of the wanted arrays of an orbax
item: orbax's own `metadata`, with type handlers that open each array's
header with tensorstore in one batch and skip the sharding files.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from flax import traverse_util

from t5x_optim._checkpoint.leaves import CheckpointError, Path, root_cause
from t5x_optim._keypaths import key_path_str

__all__ = ["open_stored"]


@dataclasses.dataclass
class _Unread(ocp.metadata.Metadata):
  """A stored array whose header was not read: not wanted, or unreadable.

  Attributes:
    error: why the header could not be read; None when it was not wanted.
  """

  error: BaseException | None = None


class _ReadsHeaders:
  """Makes an orbax type handler's `metadata` read only array headers.

  orbax's `jax.Array` handler also reads and parses every array's sharding
  file, one after another: 1.1-1.4 s for a checkpoint of 2,101 small arrays,
  against 0.24-0.50 s here (docs/benchmarks.md). The restore takes its
  shardings from the target, so only the shape and dtype are needed. Every
  wanted array is opened with orbax's own read spec and the batch is awaited
  once. An array that is not wanted, or whose header cannot be read, becomes
  an `_Unread` entry, so that every unreadable path can be named at once.

  Args:
    wanted: which arrays to open. It is given orbax's name of an array (its
      path joined by ".") split at "."; for the predicates `restore` uses,
      which look at the first key and at ``("state", "step")``, that opens
      every array whose path they want (and, where a first key holds a ".",
      perhaps some more, which the caller drops).
  """

  def __init__(self, wanted: Callable[[Path], bool]):
    super().__init__()
    self._wanted = wanted

  async def metadata(self, infos: list[ocp.type_handlers.ParamInfo]) -> list[ocp.metadata.Metadata]:
    if not infos:
      return []
    opening = {
      info.name: ts.open(
        ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=bool(info.is_ocdbt_checkpoint)),
        open=True,
        context=info.ts_context,
      )
      for info in infos
      if self._wanted(tuple(info.name.split(".")))
    }
    return await asyncio.to_thread(_headers, infos, opening)


class _ArrayHeaders(_ReadsHeaders, ocp.type_handlers.ArrayHandler):
  """`jax.Array` metadata: headers only (see `_ReadsHeaders`)."""


class _NumpyHeaders(_ReadsHeaders, ocp.type_handlers.NumpyHandler):
  """`np.ndarray` metadata: headers only (see `_ReadsHeaders`)."""


class _ScalarHeaders(_ReadsHeaders, ocp.type_handlers.ScalarHandler):
  """Scalar metadata: headers only (see `_ReadsHeaders`)."""


_HEADER_READERS = {
  ocp.type_handlers.ArrayHandler: _ArrayHeaders,
  ocp.type_handlers.NumpyHandler: _NumpyHeaders,
  ocp.type_handlers.ScalarHandler: _ScalarHeaders,
}


def _headers(
  infos: list[ocp.type_handlers.ParamInfo], opening: Mapping[str, Any]
) -> list[ocp.metadata.Metadata]:
  """The header of each array of `infos`, once `opening` (by name) is done."""
  directory = infos[0].parent_dir  # The item's: one directory for all of them.
  headers = []
  for info in infos:
    entry = _Unread(info.name, directory)
    if info.name in opening:
      try:
        array = opening[info.name].result()
      except Exception as e:  # noqa: BLE001 - tensorstore raises bare Exceptions.
        entry.error = e
      else:
        entry = ocp.metadata.ArrayMetadata(
          name=info.name,
          directory=directory,
          shape=array.shape,
          dtype=jnp.dtype(array.dtype.name),
          sharding=None,
        )
    headers.append(entry)
  return headers


def _header_reading_handler(wanted: Callable[[Path], bool]) -> ocp.PyTreeCheckpointHandler:
  """orbax's PyTree handler, its array and scalar handlers reading headers only."""
  handlers = []
  for ty in ocp.type_handlers.supported_types():
    handler = ocp.type_handlers.get_type_handler(ty)
    reader = _HEADER_READERS.get(type(handler))
    handlers.append((ty, handler if reader is None else reader(wanted)))
  registry = ocp.type_handlers.create_type_handler_registry(*handlers)
  return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def open_stored(
  item: epath.Path, where: str, step: int, wanted: Callable[[Path], bool]
) -> dict[Path, jax.ShapeDtypeStruct]:
  """The shape and dtype of the `wanted` arrays stored in the orbax item `item`.

  orbax's `metadata` reads the tree metadata file once, then opens the
  wanted arrays in one batch; tensorstore reads only their headers, no data.

  Args:
    item: the item directory of a step (``<directory>/<step>/default``).
    where: names the checkpoint in error messages.
    step: its step.
    wanted: which stored paths to open.

  Raises:
    CheckpointError: the tree metadata is unreadable, or some arrays'
      headers are, naming every such path.
  """
  handler = _header_reading_handler(wanted)
  try:
    tree = handler.metadata(item).tree
  except FileNotFoundError as e:
    raise CheckpointError(
      f"{where} has no readable tree metadata: No such file ({e})", step=step
    ) from e
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"{where} has no readable tree metadata: {e}", step=step) from e
  finally:
    handler.close()
  stored, unreadable, first_error = {}, [], None
  for path, entry in traverse_util.flatten_dict(tree).items():
    if isinstance(entry, _Unread) and entry.error is not None and wanted(path):
      unreadable.append(f"'{key_path_str(path)}'")
      first_error = first_error or entry.error
    elif isinstance(entry, ocp.metadata.ArrayMetadata) and wanted(path):
      stored[path] = jax.ShapeDtypeStruct(entry.shape, entry.dtype)
  if unreadable:
    raise CheckpointError(
      f"{where} has unreadable metadata at {', '.join(unreadable)}: {root_cause(first_error)}",
      step=step,
    ) from first_error
  return stored
