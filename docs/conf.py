"""Sphinx configuration of the chainer-vgc documentation (``make docs``).

Markdown pages go through MyST; the API pages (``api/*.rst``) are made by
autodoc from the docstrings, so the package must import: build with the
np2 venv's interpreter (``make docs`` runs ``sphinx-build`` from
``.venv-np2``), warnings being errors (``-W --keep-going``).
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# one BLAS thread: importing Chainer and NumPy should not fan out on a
# shared 2-core machine
os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')

project = 'chainer-vgc'
author = 'chainer-vgc developers'
copyright = '2018 (paper) and later, the chainer-vgc developers'
release = '0.1.0'

extensions = [
    'myst_parser',
    'sphinx.ext.autodoc',
    'sphinx.ext.napoleon',
    'sphinx.ext.viewcode',
]

source_suffix = {'.rst': 'restructuredtext', '.md': 'markdown'}
root_doc = 'index'
# the tables examples/paper_table.py wrote (results.md shows them) are data,
# not pages
exclude_patterns = ['_build', 'Thumbs.db', '.DS_Store', 'table.md',
                    'fashion_table.md', 'results_long_table.md']

# Markdown: headings up to ### get anchors, so [text](page.md#a-heading)
# links resolve and are checked
myst_heading_anchors = 3

# autodoc: members in source order; what is imported from elsewhere is
# documented where it is defined
autodoc_default_options = {
    'members': True,
    'member-order': 'bysource',
    'show-inheritance': True,
}
autodoc_typehints = 'none'
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = 'alabaster'
html_title = 'chainer-vgc'
html_static_path = []


# -- API pages: every public module of chainer_vgc is on one -----------------
#
# ``.. submodules:: PACKAGE`` in an api/*.rst page stands for one
# ``.. automodule::`` per public submodule of PACKAGE, found when the docs
# are built (the codec package's modules are listed this way).  After
# reading, every public module of the package must be documented on some
# page: one that is not is a warning, so `make docs` (-W) fails until it is
# added to the page of its concept.

import pkgutil  # noqa: E402

PACKAGE = 'chainer_vgc'

#: modules whose docstrings do not build yet (reStructuredText errors),
#: left out of the API pages until they are fixed: their automodule lines
#: are dropped, and the completeness check lets them pass.  Empty this.
API_LEFT_OUT = (
)


def public_modules(package):
    """Names of the public modules below ``package`` (imports it)."""
    import importlib
    pkg = importlib.import_module(package)
    return sorted(m.name for m in pkgutil.walk_packages(
        pkg.__path__, package + '.')
        if not any(part.startswith('_') for part in m.name.split('.')))


def _expand_submodules(app, docname, source):
    lines = []
    for line in source[0].split('\n'):
        if line.startswith('.. submodules:: '):
            package = line.split('::', 1)[1].strip()
            depth = package.count('.') + 1
            for name in public_modules(package):
                if name.count('.') == depth and name not in API_LEFT_OUT:
                    lines += ['.. automodule:: ' + name, '']
        elif (line.startswith('.. automodule:: ')
              and line.split('::', 1)[1].strip() in API_LEFT_OUT):
            continue
        else:
            lines.append(line)
    source[0] = '\n'.join(lines)


def _check_every_module_documented(app, env):
    from sphinx.util import logging
    documented = set(env.get_domain('py').modules)
    for name in [PACKAGE] + public_modules(PACKAGE):
        if name not in documented and name not in API_LEFT_OUT:
            logging.getLogger(__name__).warning(
                'module %s is on no API page: add an automodule of it to '
                'the page of its concept in docs/api/', name)


def setup(app):
    app.connect('source-read', _expand_submodules)
    app.connect('env-check-consistency', _check_every_module_documented)
