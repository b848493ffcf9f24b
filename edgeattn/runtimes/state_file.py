"""Moved to ``edgeattn.artifact.state_file`` (the artifact format's own package); this re-export keeps the
old import path working for one release."""

from edgeattn.artifact.state_file import (  # noqa: F401
    FORMAT,
    FORMAT_VERSION,
    check_state,
    load_state,
    save_state,
)
