"""A Google Cloud Storage emulator for the gs:// tests (the `gcs` fixture in conftest.py)."""

from __future__ import annotations

import gc
import itertools
import logging
import os
import socket
import socketserver

BUCKET = "diffjax-test"


class GcsEmulator:
    """gcp-storage-emulator in a thread of this process, serving one in-memory bucket. `env` points gcsfs and
    google-cloud-storage (STORAGE_EMULATOR_HOST) and tensorstore (TENSORSTORE_GCS_HTTP_URL, and a fixed token
    instead of Google credentials) at it; `url(name)` is a fresh gs:// prefix per call."""

    def __enter__(self) -> "GcsEmulator":
        from gcp_storage_emulator.server import create_server

        _send_generation_headers()
        # A line per request otherwise, and an error for each object Orbax probes for before it exists.
        logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)
        # A client that hangs up early (gcsfs, tensorstore on retries) makes the emulator print a traceback.
        socketserver.BaseServer.handle_error = lambda *_: None
        with socket.socket() as probe:
            probe.bind(("localhost", 0))
            port = probe.getsockname()[1]
        self._server = create_server("localhost", port, in_memory=True, default_bucket=BUCKET)
        self._server.start()
        endpoint = f"http://localhost:{port}"
        self.env = {"STORAGE_EMULATOR_HOST": endpoint, "TENSORSTORE_GCS_HTTP_URL": endpoint,
                    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "GOOGLE_CLOUD_PROJECT": "diffjax-test"}
        self._saved = {key: os.environ.get(key) for key in self.env}
        os.environ.update(self.env)
        self._names = itertools.count()
        return self

    def url(self, name: str) -> str:
        return f"gs://{BUCKET}/{name}-{next(self._names)}"

    def __exit__(self, *_) -> None:
        gc.collect()  # tensorboardX's gs:// writers upload once more when collected: while the emulator still serves
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._server.stop()


def _send_generation_headers() -> None:
    """The emulator's downloads leave out the x-goog-generation header real GCS sends, which tensorstore (Orbax's
    checkpoints) reads as the object's version ("Malformed StorageGeneration" without it): added here."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    download = objects.download
    if getattr(download, "sends_generation", False):
        return

    def download_with_generation(request, response, storage, *args, **kwargs):
        download(request, response, storage, *args, **kwargs)
        if response.status.value in (200, 206):
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            response["x-goog-generation"] = str(obj["generation"])
            response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))

    download_with_generation.sends_generation = True
    objects.download = download_with_generation  # objects.get's alt=media calls it by name
    for _, methods in server.HANDLERS:
        for method, handler in methods.items():
            if handler is download:
                methods[method] = download_with_generation
