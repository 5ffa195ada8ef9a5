"""The project's source tree, copied without what a build, a venv or a
test run left in it: what a clean checkout would hold, for the tests that
build or install from one (tests/test_install.py, tests/test_packaging.py).
"""

import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def copy_source_tree(dst):
    """The source tree without build outputs or the venv."""
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(
        '.venv', '.venv-*', 'gpu_carry', '.git', 'build', 'dist',
        '*.egg-info', '__pycache__',
        '*.so', 'result', '.pytest_cache', '.hypothesis'))
