"""Moved to ``edgeattn.artifact.manifest`` (the artifact format's own package); this re-export keeps the
old import path working for one release."""

from edgeattn.artifact.manifest import (  # noqa: F401
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    Manifest,
    StateEntry,
    check_structure,
    sha256_file,
    write_manifest,
)
