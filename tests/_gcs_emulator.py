"""A local Google Cloud Storage: `gcp-storage-emulator`, with generation preconditions.

Run as a script, it serves on 127.0.0.1 until killed:

  python tests/_gcs_emulator.py PORT

The emulator ignores ``ifGenerationMatch``, sends no ``x-goog-generation``
with a download and lists a whole bucket for a listing within
``startOffset``/``endOffset`` (tensorstore's, which aborts on the keys it did
not ask for); real GCS does all three right, and the writer lease of
`Checkpointer` depends on the first two. So this script makes the
emulator's object inserts and deletes check ``ifGenerationMatch`` (``0``: the
object must not exist), answering 412 as GCS does, its downloads name the
generation and its listings keep to the offsets. It also answers
``Expect: 100-continue`` (curl, under tensorstore, otherwise waits a second
before each upload over 1 MB) and queues up to 256 connections, not 5 (past
those a connection waits a second for a TCP retransmit), as a server under
concurrent clients must. To try the clients' retries, the first download of
every object whose name contains ``flaky`` answers 503 (Service Unavailable),
a transient error of real GCS. Everything else is the emulator's own.
`Emulator` starts the script on a free port and points tensorstore
(``TENSORSTORE_GCS_HTTP_URL``) and gcsfs (``STORAGE_EMULATOR_HOST``) at it.
"""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from http import HTTPStatus

from _subprocesses import free_port

ENV = {
  # gcsfs asks GCS's control plane for the bucket type; the emulator has none.
  # Read when gcsfs is imported: import this module first.
  "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
  # Where TensorFlow is installed (T5X's environment), epath sends gs:// through its gfile,
  # which has no emulator endpoint: gcsfs then too. Read at epath's first gs:// path.
  "EPATH_USE_TF": "false",
}
os.environ.update(ENV)


class Emulator:
  """The emulator in a subprocess on a free localhost port, and the environment that uses it.

  Example (not run: it starts a server):
    with Emulator() as emulator:
      emulator.create_bucket("bkt")
  """

  def __init__(self) -> None:
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.env = {**ENV, "STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url}
    self._process: subprocess.Popen | None = None
    self._saved: dict[str, str | None] = {}

  def __enter__(self) -> Emulator:
    self._process = subprocess.Popen(
      [sys.executable, __file__, str(self.port)],
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
      try:
        socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        break
      except OSError:
        if self._process.poll() is not None or time.monotonic() > deadline:
          self._process.kill()
          raise RuntimeError(f"gcp-storage-emulator did not start on port {self.port}") from None
        time.sleep(0.1)
    self._saved = {key: os.environ.get(key) for key in self.env}
    os.environ.update(self.env)
    return self

  def __exit__(self, *exc_info: object) -> None:
    for key, value in self._saved.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value
    if self._process is not None:
      self._process.kill()
      self._process.wait()

  def create_bucket(self, name: str) -> None:
    """Creates bucket `name` (the JSON API's buckets.insert)."""
    import json  # noqa: PLC0415

    self._post(
      "/storage/v1/b?project=test", json.dumps({"name": name}).encode(), "application/json"
    )

  def upload(self, bucket: str, name: str, data: bytes) -> None:
    """Writes object `name` of `bucket` (the JSON API's media upload)."""
    import urllib.parse  # noqa: PLC0415

    query = urllib.parse.urlencode({"uploadType": "media", "name": name})
    self._post(f"/upload/storage/v1/b/{bucket}/o?{query}", data, "application/octet-stream")

  def _post(self, path: str, data: bytes, content_type: str) -> None:
    import urllib.request  # noqa: PLC0415

    request = urllib.request.Request(
      self.url + path, data=data, headers={"Content-Type": content_type}, method="POST"
    )
    with urllib.request.urlopen(request) as response:
      response.read()


def _serve(port: int) -> None:
  from gcp_storage_emulator.exceptions import NotFound  # noqa: PLC0415
  from gcp_storage_emulator.handlers import objects  # noqa: PLC0415

  lock = threading.Lock()

  def current_generation(storage, bucket: str, name: str) -> str:
    try:
      return str(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
      return "0"

  def guarded(handler, name_of):
    def handle(request, response, storage, *args, **kwargs):
      wanted = request.query.get("ifGenerationMatch")
      with lock:
        if wanted:
          bucket = request.params["bucket_name"]
          if current_generation(storage, bucket, name_of(request)) != wanted[0]:
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json({"error": {"code": 412, "message": "conditionNotMet"}})
            return None
        return handler(request, response, storage, *args, **kwargs)

    return handle

  def inserted_name(request) -> str:
    if "name" in request.query:
      return request.query["name"][0]
    meta = request.data.get("meta", request.data) if isinstance(request.data, dict) else {}
    return meta.get("name", "")

  failed: set[tuple[str, str]] = set()

  def with_generation(handler):
    """Downloads answer with the object's generation, as GCS does (``x-goog-generation``).

    The first download of an object whose name contains ``flaky`` answers 503.
    """

    def handle(request, response, storage, *args, **kwargs):
      bucket, name = request.params["bucket_name"], request.params["object_id"]
      with lock:
        first = "flaky" in name and (bucket, name) not in failed
        failed.add((bucket, name))
      if first:
        response.status = HTTPStatus.SERVICE_UNAVAILABLE
        response.json({"error": {"code": 503, "message": "Service Unavailable"}})
        return None
      generation = current_generation(storage, bucket, name)
      if generation != "0":
        response["x-goog-generation"] = generation
      return handler(request, response, storage, *args, **kwargs)

    return handle

  def ls(request, response, storage, *args, **kwargs):
    """Lists as the emulator does, within ``startOffset``/``endOffset`` (tensorstore sends them)."""
    query = {key: values[0] for key, values in request.query.items()}
    try:
      files, prefixes = storage.get_file_list(
        request.params["bucket_name"],
        query.get("prefix"),
        query.get("delimiter"),
        query.get("matchGlob"),
      )
    except NotFound:
      response.status = HTTPStatus.NOT_FOUND
      return
    start, end = query.get("startOffset", ""), query.get("endOffset")
    files = [f for f in files if f["name"] >= start and (end is None or f["name"] < end)]
    response.json({"kind": "storage#objects", "prefixes": prefixes, "items": files})

  objects.ls = ls
  objects.insert = guarded(objects.insert, inserted_name)
  objects.download = with_generation(objects.download)
  objects.delete = guarded(objects.delete, lambda r: r.params["object_id"])

  from gcp_storage_emulator import server  # noqa: PLC0415 - after the patches above

  parse_request = server.RequestHandler.parse_request

  def parse_request_continuing(self) -> bool:
    """Answers ``Expect: 100-continue`` at once, as GCS does.

    The emulator speaks HTTP/1.0, where `http.server` ignores the header, and
    curl (tensorstore's client) then waits a second before sending each body
    over 1 MB.
    """
    if not parse_request(self):
      return False
    if self.headers.get("Expect", "").lower() == "100-continue":
      self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
      self.wfile.flush()
    return True

  server.RequestHandler.parse_request = parse_request_continuing
  # tensorstore opens dozens of connections at once; past http.server's backlog of 5,
  # connections wait for a TCP retransmit (a second).
  http.server.HTTPServer.request_queue_size = 256
  create_server = server.create_server

  create_server("127.0.0.1", port, in_memory=True).run()


if __name__ == "__main__":
  _serve(int(sys.argv[1]))
