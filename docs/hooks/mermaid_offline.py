"""mkdocs hook: ship Mermaid with the site, so the diagrams render without internet.

mkdocs-material renders ```` ```mermaid ```` blocks with the global ``mermaid`` object and
fetches it from a CDN only when the page has none. This hook adds Mermaid's own build
(:data:`VERSION`, from the npm registry, checked against :data:`TARBALL_SHA256`) to the
site as ``assets/javascripts/mermaid.min.js`` and loads it on every page, so a site built
here renders its state machines on a machine that reaches no network (GPU clusters often
reach none).

The file is downloaded once into ``$KVSPEC_CACHE_DIR`` (default ``~/.cache/kvspec``) and
never committed: building the site needs the registry the first time, like ``pip install``.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import urllib.request
from pathlib import Path
from typing import Any

VERSION = "11.4.1"
TARBALL_URL = f"https://registry.npmjs.org/mermaid/-/mermaid-{VERSION}.tgz"
TARBALL_SHA256 = "ec7b61b391aaa24bf666fd20e48d0a626eeb4a95b95bc6b3016a122d7f0bc2af"
SITE_PATH = "assets/javascripts/mermaid.min.js"
_MEMBER = "package/dist/mermaid.min.js"


def cached_script() -> Path:
    """The path of Mermaid's ``mermaid.min.js`` in the cache, downloaded first if needed.

    Raises:
        RuntimeError: the download failed or its checksum is not the pinned one.
    """
    cache = Path(os.environ.get("KVSPEC_CACHE_DIR") or Path.home() / ".cache" / "kvspec")
    path = cache / f"mermaid-{VERSION}.min.js"
    if path.is_file():
        return path
    try:
        with urllib.request.urlopen(TARBALL_URL, timeout=120) as response:
            data = response.read()
    except OSError as e:
        raise RuntimeError(
            f"cannot download Mermaid {VERSION} from {TARBALL_URL} ({e}); the docs build "
            f"needs it once, then reads it from {path}"
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != TARBALL_SHA256:
        raise RuntimeError(
            f"{TARBALL_URL} has sha256 {digest}, expected {TARBALL_SHA256}: refusing it"
        )
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        member = tar.extractfile(_MEMBER)
        if member is None:
            raise RuntimeError(f"{TARBALL_URL} holds no {_MEMBER}")
        script = member.read()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(script)
    tmp.replace(path)
    return path


def on_config(config: Any) -> Any:
    """Load the shipped Mermaid on every page (before material looks for it)."""
    if SITE_PATH not in [str(s) for s in config.extra_javascript]:
        config.extra_javascript.append(SITE_PATH)
    return config


def on_files(files: Any, config: Any) -> Any:
    """Add the cached ``mermaid.min.js`` to the site's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, SITE_PATH, abs_src_path=str(cached_script())))
    return files
