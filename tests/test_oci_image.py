"""`make oci` / `make publish`: the .wasm as an OCI image in the variant Istio pulls, built
without docker, reproducible, and pushed to a real registry (Debian's docker-registry on a
free loopback port) whose HTTP API then serves exactly what was built.

What Istio's agent accepts (istio/istio pkg/wasm/imagefetcher.go): an OCI or Docker v2
manifest whose *last* layer is `application/vnd.oci.image.layer.v1.tar+gzip` (OCI) holding a
file whose base name is `plugin.wasm`; the `sha256` of a WasmPlugin with an `oci://` url is
the manifest's digest. `istio_extract` below restates those rules to check the image.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from harness.proc import ROOT, reserve_dead_port
from harness.registry import OCI_MANIFEST, Registry

sys.path.insert(0, str(ROOT / "deploy"))
import wasm_image  # noqa: E402

WASM = ROOT / "target" / "wasm32-wasip1" / "release" / "coordination_guard.wasm"
LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
CONFIG = "application/vnd.oci.image.config.v1+json"
REPO = "coordination-guard"


def make(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def printed_sha256(output: str) -> str:
    found = re.findall(r"^WasmPlugin sha256: ([0-9a-f]{64})$", output, flags=re.M)
    assert len(found) == 1, output
    return found[0]


def istio_extract(manifest: dict, blob) -> bytes:
    """plugin.wasm the way Istio's image fetcher finds it in a compat image."""
    last = manifest["layers"][-1]
    assert last["mediaType"] == LAYER, last
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob(last["digest"])))) as tar:
        for member in tar:
            if Path(member.name).name == "plugin.wasm":
                return tar.extractfile(member).read()
    raise AssertionError("plugin.wasm not in the last layer")


def read_layout(layout: Path, tag: str) -> tuple[bytes, dict]:
    index = json.loads((layout / "index.json").read_text())
    [entry] = [m for m in index["manifests"]
               if m["annotations"]["org.opencontainers.image.ref.name"] == tag]
    raw = (layout / "blobs" / "sha256" / entry["digest"].split(":")[1]).read_bytes()
    assert entry["mediaType"] == OCI_MANIFEST and entry["size"] == len(raw)
    return raw, json.loads(raw)


def check_compat_image(manifest: dict, blob, wasm: bytes) -> None:
    assert manifest["schemaVersion"] == 2 and manifest["mediaType"] == OCI_MANIFEST
    assert manifest["annotations"]["module.wasm.image/variant"] == "compat"
    assert manifest["config"]["mediaType"] == CONFIG
    assert [layer["mediaType"] for layer in manifest["layers"]] == [LAYER]
    for d in [manifest["config"], *manifest["layers"]]:
        data = blob(d["digest"])
        assert "sha256:" + hashlib.sha256(data).hexdigest() == d["digest"] and len(data) == d["size"]
    assert istio_extract(manifest, blob) == wasm


@pytest.fixture(scope="module")
def wasm() -> bytes:
    assert WASM.exists(), f"{WASM} is missing: run `make build`"
    return WASM.read_bytes()


def test_image_layout_is_the_compat_variant_and_reproducible(tmp_path, wasm):
    digest = wasm_image.build(WASM, tmp_path / "a", "t1")
    raw, manifest = read_layout(tmp_path / "a", "t1")
    assert hashlib.sha256(raw).hexdigest() == digest
    blobs = tmp_path / "a" / "blobs" / "sha256"
    check_compat_image(manifest, lambda d: (blobs / d.split(":")[1]).read_bytes(), wasm)
    assert json.loads((tmp_path / "a" / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}

    # Nothing that varies between builds: gzip mtime 0, tar entry fixed.
    layer = (blobs / manifest["layers"][0]["digest"].split(":")[1]).read_bytes()
    assert layer[:3] == b"\x1f\x8b\x08" and layer[4:8] == b"\0\0\0\0"
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(layer))) as tar:
        [member] = tar.getmembers()
    assert (member.name, member.mtime, member.uid, member.gid, member.mode, member.uname) == \
        ("plugin.wasm", 0, 0, 0, 0o644, "")
    config = json.loads((blobs / manifest["config"]["digest"].split(":")[1]).read_bytes())
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(gzip.decompress(layer)).hexdigest()]

    # Same .wasm, another time and place: the same digest; another .wasm: another digest.
    assert wasm_image.build(WASM, tmp_path / "b", "t1") == digest
    assert sorted(p.name for p in blobs.iterdir()) == \
        sorted(p.name for p in (tmp_path / "b" / "blobs" / "sha256").iterdir())
    other = tmp_path / "other.wasm"
    other.write_bytes(wasm + b"\0")
    assert wasm_image.build(other, tmp_path / "c", "t1") != digest
    # A rebuild replaces the layout instead of piling up blobs; a foreign directory is kept.
    assert wasm_image.build(WASM, tmp_path / "c", "t1") == digest
    assert len(list((tmp_path / "c" / "blobs" / "sha256").iterdir())) == 3
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "keep").write_text("x")
    with pytest.raises(SystemExit, match="not an OCI image layout"):
        wasm_image.build(WASM, tmp_path / "d", "t1")
    assert (tmp_path / "d" / "keep").exists()


def test_make_oci_prints_the_manifest_digest(tmp_path, wasm):
    result = make("oci", f"OCI_DIR={tmp_path / 'oci'}", "OCI_TAG=t2")
    assert result.returncode == 0, result.stdout + result.stderr
    raw, _ = read_layout(tmp_path / "oci", "t2")
    assert printed_sha256(result.stdout) == hashlib.sha256(raw).hexdigest()


def test_make_publish_pushes_the_same_manifest_to_a_real_registry(tmp_path, wasm):
    registry = Registry(tmp_path / "registry").start()
    try:
        image = f"{registry.address}/{REPO}:e2e"
        result = make("publish", f"IMAGE={image}", "PLAIN_HTTP=1", f"OCI_DIR={tmp_path / 'oci'}",
                      "OCI_TAG=t3")
        assert result.returncode == 0, result.stdout + result.stderr
        built, published = re.findall(r"^WasmPlugin sha256: ([0-9a-f]{64})$", result.stdout, flags=re.M)
        assert built == published
        assert f"pushed oci://{image}" in result.stdout

        raw, header_digest, content_type = registry.manifest(REPO, "e2e")
        assert header_digest == f"sha256:{built}" == "sha256:" + hashlib.sha256(raw).hexdigest()
        assert content_type == OCI_MANIFEST
        assert raw == read_layout(tmp_path / "oci", "t3")[0]  # byte for byte what was built
        check_compat_image(json.loads(raw), lambda d: registry.blob(REPO, d), wasm)
        # The digest reference Istio pulls by (oci://...@sha256:<digest>) serves it too.
        assert registry.manifest(REPO, header_digest)[1] == header_digest
    finally:
        registry.stop()
    assert not registry.alive()


def test_make_publish_needs_an_image(tmp_path):
    result = make("publish", f"OCI_DIR={tmp_path / 'oci'}")
    assert result.returncode != 0
    assert "usage: make publish IMAGE=" in result.stdout


def test_make_publish_to_a_plain_http_registry_without_plain_http_gives_the_hint(tmp_path, wasm):
    registry = Registry(tmp_path / "registry").start()
    try:
        image = f"{registry.address}/{REPO}:hint"
        result = make("publish", f"IMAGE={image}", f"OCI_DIR={tmp_path / 'oci'}", "OCI_TAG=t4")
    finally:
        registry.stop()
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert (f"error: {registry.address} speaks plain HTTP, not HTTPS: push to it with PLAIN_HTTP=1\n"
            f"hint: make publish IMAGE={image} PLAIN_HTTP=1\n") in result.stderr, result.stderr
    assert "pushed oci://" not in result.stdout


def test_another_skopeo_failure_shows_its_error_without_a_traceback(tmp_path, wasm):
    layout = tmp_path / "oci"
    wasm_image.build(WASM, layout, "t5")
    sock, port = reserve_dead_port()  # nothing listens: the connection is refused
    try:
        image = f"127.0.0.1:{port}/{REPO}:refused"
        result = subprocess.run([sys.executable, str(ROOT / "deploy" / "wasm_image.py"), "publish",
                                 "--layout", str(layout), "--tag", "t5", "--image", image,
                                 "--plain-http"], capture_output=True, text=True, timeout=300,
                                stdin=subprocess.DEVNULL)
    finally:
        sock.close()
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "connection refused" in result.stderr, result.stderr  # skopeo's own words
    assert result.stderr.rstrip().endswith(
        f"error: skopeo could not push {image} (exit 1; its output is above)"), result.stderr
    assert "PLAIN_HTTP" not in result.stderr
