#!/usr/bin/env python3
"""coordination-guard's .wasm as an OCI image Istio can pull, built without docker.

    python3 deploy/wasm_image.py build --wasm <.wasm> --out build/oci --tag 0.1.0
    python3 deploy/wasm_image.py publish --layout build/oci --tag 0.1.0 \
        --image registry.example.com/coordination-guard:0.1.0 [--plain-http]

`build` writes an OCI image layout (oci-layout, index.json, blobs/sha256/...) holding one image
in the "compat" variant of the Wasm image spec, the one Istio's image fetcher accepts: an OCI
manifest whose last (and only) layer is `application/vnd.oci.image.layer.v1.tar+gzip` with a
`plugin.wasm` entry, annotated `module.wasm.image/variant=compat`. It prints the manifest
digest: that is what a `WasmPlugin`'s `sha256` holds for an `oci://` url.

The image is reproducible: the tar has one entry with fixed owner, mode and mtime 0, gzip's
header has mtime 0 and no file name, and every JSON document is written with sorted keys and
no spaces. The same .wasm gives the same digest (with the same zlib; Python's stdlib only).

`publish` pushes the layout with `skopeo copy --preserve-digests` (the registry keeps the
manifest byte for byte, so the digest stays the one `build` printed) and prints the digest the
registry reports. `--plain-http` is for a registry on plain HTTP (e.g. a loopback test
registry); credentials come from skopeo's usual auth file (`skopeo login`).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
VARIANT_ANNOTATION = "module.wasm.image/variant"
REF_NAME = "org.opencontainers.image.ref.name"
PLUGIN_FILE = "plugin.wasm"


def canonical_json(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def layer_tar(wasm: bytes) -> bytes:
    """A tar with exactly one regular file, `plugin.wasm`, and nothing that varies."""
    info = tarfile.TarInfo(PLUGIN_FILE)
    info.size = len(wasm)
    info.mode = 0o644
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(wasm))
    return out.getvalue()


def descriptor(media_type: str, blob: bytes, annotations: dict | None = None) -> dict:
    d = {"mediaType": media_type, "digest": "sha256:" + hashlib.sha256(blob).hexdigest(),
         "size": len(blob)}
    if annotations:
        d["annotations"] = annotations
    return d


def image_blobs(wasm: bytes) -> tuple[bytes, bytes, bytes]:
    """(layer, config, manifest) blobs of the compat image for `wasm`."""
    tar = layer_tar(wasm)
    layer = gzip.compress(tar, compresslevel=9, mtime=0)
    config = canonical_json({
        # Go's names for the WASI target, as OCI platforms use GOARCH/GOOS values.
        "architecture": "wasm",
        "os": "wasip1",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar).hexdigest()]},
    })
    manifest = canonical_json({
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": descriptor(CONFIG_TYPE, config),
        "layers": [descriptor(LAYER_TYPE, layer)],
        "annotations": {VARIANT_ANNOTATION: "compat"},
    })
    return layer, config, manifest


def build(wasm_path: Path, out: Path, tag: str) -> str:
    """Write the image layout to `out` (replacing an earlier layout there); returns the
    manifest digest's hex (a WasmPlugin's `sha256`)."""
    wasm = wasm_path.read_bytes()
    if wasm[:4] != b"\0asm":
        raise SystemExit(f"{wasm_path} is not a WebAssembly module")
    if out.exists():
        if not (out / "oci-layout").exists() and any(out.iterdir()):
            raise SystemExit(f"{out} exists and is not an OCI image layout; not replacing it")
        shutil.rmtree(out)
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    layer, config, manifest = image_blobs(wasm)
    for blob in (layer, config, manifest):
        (blobs / hashlib.sha256(blob).hexdigest()).write_bytes(blob)
    (out / "oci-layout").write_bytes(canonical_json({"imageLayoutVersion": "1.0.0"}))
    index = {"schemaVersion": 2, "mediaType": INDEX_TYPE,
             "manifests": [descriptor(MANIFEST_TYPE, manifest, {REF_NAME: tag})]}
    (out / "index.json").write_bytes(canonical_json(index))
    return hashlib.sha256(manifest).hexdigest()


def layout_digest(layout: Path, tag: str) -> str:
    index = json.loads((layout / "index.json").read_text())
    for m in index["manifests"]:
        if m.get("annotations", {}).get(REF_NAME) == tag:
            return m["digest"].split(":", 1)[1]
    raise SystemExit(f"{layout} has no image tagged {tag!r}; run `make oci`")


# What skopeo (Go's HTTP client) says when it spoke HTTPS to a registry that answers in HTTP.
PLAIN_HTTP_ANSWER = "server gave HTTP response to HTTPS client"


def run_skopeo(argv: list[str], image: str, timeout: float = 300) -> None:
    """Runs skopeo (its progress on stdout as it comes); a failure ends the program with one
    line that says why (and, for a plain-HTTP registry, the command that pushes to it), or with
    skopeo's own error output: never a traceback."""
    try:
        result = subprocess.run(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"error: skopeo did not finish pushing {image} within {timeout:.0f} s")
    if result.returncode == 0:
        sys.stderr.write(result.stderr)
        return
    if PLAIN_HTTP_ANSWER in result.stderr:
        registry = image.split("/", 1)[0]
        raise SystemExit(f"error: {registry} speaks plain HTTP, not HTTPS: push to it with "
                         f"PLAIN_HTTP=1\nhint: make publish IMAGE={image} PLAIN_HTTP=1")
    sys.stderr.write(result.stderr)
    raise SystemExit(f"error: skopeo could not push {image} (exit {result.returncode}; its "
                     "output is above)")


def publish(layout: Path, tag: str, image: str, plain_http: bool) -> str:
    skopeo = shutil.which("skopeo")
    if skopeo is None:
        raise SystemExit("skopeo is not installed; run `make deps-oci`")
    expected = layout_digest(layout, tag)
    digest_file = layout / f"pushed-{tag}.digest"
    argv = [skopeo, "copy", "--preserve-digests", "--digestfile", str(digest_file)]
    if plain_http:
        argv.append("--dest-tls-verify=false")
    argv += [f"oci:{layout}:{tag}", f"docker://{image}"]
    run_skopeo(argv, image)
    pushed = digest_file.read_text().strip().split(":", 1)[1]
    digest_file.unlink()
    if pushed != expected:
        raise SystemExit(f"the registry holds manifest {pushed}, not the built {expected}")
    return pushed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the OCI image layout")
    b.add_argument("--wasm", type=Path, required=True)
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--tag", required=True)
    p = sub.add_parser("publish", help="push the layout's image with skopeo")
    p.add_argument("--layout", type=Path, required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--image", required=True, help="registry/repository:tag")
    p.add_argument("--plain-http", action="store_true", help="the registry speaks plain HTTP")
    args = parser.parse_args(argv)
    if args.cmd == "build":
        digest = build(args.wasm, args.out, args.tag)
        print(f"OCI image layout: {args.out} (tag {args.tag}), plugin.wasm from {args.wasm}")
        print(f"manifest digest: sha256:{digest}")
        print(f"WasmPlugin sha256: {digest}")
    else:
        digest = publish(args.layout, args.tag, args.image, args.plain_http)
        print(f"pushed oci://{args.image}")
        print(f"WasmPlugin sha256: {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
