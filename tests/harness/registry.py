"""A real OCI registry (Debian's `docker-registry`, the CNCF distribution registry) on a free
loopback port, plain HTTP, storing under its workdir; `make publish` pushes to it in tests.

    registry = Registry(tmp_path / "registry").start()
    registry.manifest("coordination-guard", "0.1.0")  # (raw bytes, Docker-Content-Digest)
    registry.stop()
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from .proc import Service, free_port, require_binary, wait_http

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


class Registry(Service):
    def __init__(self, workdir: Path, port: int | None = None):
        self.workdir = Path(workdir).resolve()
        self.port = port or free_port()
        self.storage = self.workdir / "storage"
        self.config_path = self.workdir / "config.yml"

    @property
    def address(self) -> str:
        """`host:port`, as an image reference's registry part."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def config(self) -> dict:
        return {
            "version": 0.1,
            "log": {"level": "info"},
            "storage": {"filesystem": {"rootdirectory": str(self.storage)},
                        "delete": {"enabled": True}},
            "http": {"addr": self.address},
        }

    def start(self, timeout: float = 15.0) -> "Registry":
        binary = require_binary("docker-registry", fix="make deps-oci")
        self.storage.mkdir(parents=True, exist_ok=True)
        # JSON is YAML: the registry reads this file as its YAML config.
        self.config_path.write_text(json.dumps(self.config(), indent=2) + "\n")
        self.launch(f"registry-{self.port}", [binary, "serve", str(self.config_path)],
                    self.workdir, self.port, timeout)
        try:
            wait_http(f"{self.url}/v2/", timeout, self.proc, expect=200)
        except Exception:
            self.proc.stop()
            raise
        return self

    def get(self, path: str, accept: str | None = None, timeout: float = 10.0) -> tuple[bytes, dict[str, str]]:
        req = urllib.request.Request(self.url + path, headers={"Accept": accept} if accept else {})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read(), {k.lower(): v for k, v in resp.headers.items()}

    def manifest(self, repository: str, reference: str) -> tuple[bytes, str, str]:
        """(raw manifest, Docker-Content-Digest, Content-Type) as the registry serves it to a
        client that accepts OCI manifests."""
        body, headers = self.get(f"/v2/{repository}/manifests/{reference}", accept=OCI_MANIFEST)
        return body, headers["docker-content-digest"], headers["content-type"]

    def blob(self, repository: str, digest: str) -> bytes:
        return self.get(f"/v2/{repository}/blobs/{digest}")[0]
