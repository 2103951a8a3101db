"""Sphinx configuration of ddpkit's manual: ``make docs`` builds it into ``site/`` in strict mode."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import ddpkit  # noqa: E402
from sphinx.ext.napoleon.docstring import GoogleDocstring  # noqa: E402

project = "ddpkit"
copyright = "2026, the ddpkit developers; Apache License 2.0"
release = version = ddpkit.__version__
extensions = [
    "myst_parser",              # the pages are Markdown
    "sphinx.ext.autodoc",       # the API reference from the docstrings
    "sphinx.ext.napoleon",      # their Google-style Args/Returns/Raises sections
    "sphinxarg.ext",            # the CLI reference from ddpkit's real parsers
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = f"ddpkit {release}"
myst_heading_anchors = 3
autodoc_typehints = "description"
autodoc_member_order = "bysource"
# Strict: every reference must resolve (make docs runs sphinx-build -W -n). Two kinds are let
# through: the libraries ddpkit names in its signatures (no network at build time, so no
# intersphinx inventories), and references from the public docstrings into ddpkit's internal
# modules, which the manual does not document one by one (the architecture page describes them).
nitpicky = True
# Flags stay as typed: no smart dashes (--workers is not an en dash and 'workers'), no curly quotes.
smartquotes = False
# A code block no highlighter can lex (a diagram, a listing of layers) stays as text.
suppress_warnings = ["misc.highlighting_failure"]
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|os|pathlib|collections|contextlib|typing|types|argparse|datetime|io|enum|abc)(\..*)?"),
    (r"py:.*", r"(Path|Any|Callable|Iterator|Iterable|Mapping|MutableMapping|Sequence|ContextManager|IO)"),
    (r"py:.*", r"ddpkit\.(_torch|distributed|state|loop|parallel|observe|checkpoint|runtime|recipes|bench|cli)\..*"),
    # internal types a public signature names through an import made for annotations only
    (r"py:class", r"(RunState|resuming\.Peers|Reporter)"),
]



def _prose_attribute(self):
    """ddpkit's field and property docstrings are prose: napoleon would read a first line ``text:
    more`` as ``type: description``; the type comes from the annotation instead."""
    return self._consume_to_end()


GoogleDocstring._parse_attribute_docstring = _prose_attribute
