"""Sphinx configuration of mlfabric's documentation: Markdown pages (myst-parser) and API pages
generated from the docstrings (autodoc). Build (build/ is ignored by git):

    sphinx-build -b html -W --keep-going docs build/docs
"""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))
# autodoc imports the package, and with it mpi4py: as root Open MPI wants these even for a
# singleton process.
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")

# mlfabric's communication API is imported at first use (PEP 562); autodoc reads a module's
# attributes, so the lazy names are resolved once here.
import mlfabric  # noqa: E402

for _name in mlfabric.__all__:
    getattr(mlfabric, _name)

project = "mlfabric"
author = "mlfabric contributors"
release = "0.1.0"

extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "requirements.txt"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_default_options = {"undoc-members": False}
# Links from the pages to files outside docs/ (README.md, BENCHMARKS.md, benchmarks/, .ci/) are
# for readers of the repository; tests/unit/test_docs.py checks that each one resolves.
suppress_warnings = ["myst.xref_missing"]
html_theme = "alabaster"


def _verbatim(app, what, name, obj, options, lines):
    """mlfabric's docstrings are plain text written for help(), not reStructuredText: shown as
    written (a literal block), so their indented examples and lists read as in the source."""
    if any(line.strip() for line in lines):
        text = list(lines)
        lines[:] = ["::", ""] + ["   " + line for line in text] + [""]


def setup(app):
    app.connect("autodoc-process-docstring", _verbatim)
