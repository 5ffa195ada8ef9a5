"""The package's structure, checked from its source (``ast``), not by
importing it:

* the import graph among ``chainer_vgc`` modules has no cycle (every
  ``import chainer_vgc.x``, ``from chainer_vgc import x``, ``from
  chainer_vgc.x import y`` and relative import counts, inside functions
  too; dynamic imports by ``importlib`` do not);
* no module imports another module's private (``_name``) names, except
  between modules of one subpackage (``chainer_vgc.codec.*`` share theirs);
  nor does a test, benchmark or example use a private name of
  ``chainer_vgc.codec`` or ``chainer_vgc.backends.cuda.kernels``;
* no module reads or sets a private attribute that a class of another
  subpackage (or top-level module) defines, on an object that is not
  ``self`` (:func:`reached_attributes`; by name, so a name computed at run
  time is not seen);
* no module passes :data:`MAX_LINES` (600): over about that, or with a
  class of more than one job, a module is a smell (issue 37: the old hard
  limit of 400 split files by size, not by concept; a module that grows
  past it is cut along a concept, never only to be shorter);
* the core imports neither Chainer nor MPI (a fresh interpreter);
* setup.cfg ships every package.
"""

import ast
import configparser
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = 'chainer_vgc'
MAX_LINES = 600

#: imports of another module's private names that exist today:
#: (importer, owner module, name).  May only shrink.
KNOWN_PRIVATE_IMPORTS = set()

#: the chainer-free core: imports neither Chainer nor MPI
CORE = ('chainer_vgc', 'chainer_vgc.codec',
        'chainer_vgc.backends.cuda.kernels', 'chainer_vgc.rules',
        'chainer_vgc.compressor', 'chainer_vgc.exchange.mean',
        'chainer_vgc.chainermn.transport')
FORBIDDEN = ('chainer', 'chainermn', 'mpi4py')


# ---- the modules and their imports ------------------------------------------

def _is_private(name):
    return name.startswith('_') and not (name.startswith('__')
                                         and name.endswith('__'))


def package_modules(root=ROOT):
    """{dotted name: path} of every module of the package (directories with
    an ``__init__.py``; a package is named by its ``__init__.py``)."""
    modules = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, PACKAGE)):
        if '__init__.py' not in filenames:
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if d != '__pycache__')
        rel = os.path.relpath(dirpath, root).split(os.sep)
        for f in sorted(filenames):
            if not f.endswith('.py'):
                continue
            parts = rel if f == '__init__.py' else rel + [f[:-3]]
            modules['.'.join(parts)] = os.path.join(dirpath, f)
    return modules


def is_package(name, modules):
    return modules.get(name, '').endswith('__init__.py')


def package_of(name, modules):
    """The package a module belongs to (a package: itself)."""
    return name if is_package(name, modules) else name.rpartition('.')[0]


class Import(object):
    """One imported module (``target``), with the name taken from it
    (``name``, or None for a whole-module import) and the source line."""

    def __init__(self, target, name, line):
        self.target, self.name, self.line = target, name, line


def _resolve_from(node, importer, modules):
    """The absolute module of a ``from ... import`` statement."""
    if node.level == 0:
        return node.module or ''
    base = package_of(importer, modules).split('.')
    base = base[:len(base) - (node.level - 1)]
    return '.'.join(base + ([node.module] if node.module else []))


def imports_of(importer, tree, modules):
    """The imports of chainer_vgc modules in ``tree`` (the whole tree:
    imports inside functions count), and the names bound to modules:
    ``([Import], {local name: module})``."""
    found, bound = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split('.')[0] != PACKAGE:
                    continue
                found.append(Import(alias.name, None, node.lineno))
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[PACKAGE] = PACKAGE
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(node, importer, modules)
            if base.split('.')[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = base + '.' + alias.name
                if sub in modules:  # a module: from chainer_vgc import codec
                    found.append(Import(sub, None, node.lineno))
                    bound[alias.asname or alias.name] = sub
                else:  # a name defined in ``base``
                    found.append(Import(base, alias.name, node.lineno))
    return found, bound


def parse(path):
    with open(path) as f:
        return ast.parse(f.read(), filename=path)


def import_graph(modules):
    """{module: sorted modules it imports} among ``modules``."""
    graph = {}
    for name, path in modules.items():
        found, _ = imports_of(name, parse(path), modules)
        graph[name] = sorted({i.target for i in found
                              if i.target in modules and i.target != name})
    return graph


def find_cycle(graph):
    """A cycle of ``graph`` ({node: [successors]}) as the list of its nodes
    in order (the first repeated at the end), or None."""
    state = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(graph.get(start, ()))]
        state[start] = 1
        while stack:
            for nxt in stack[-1]:
                if state.get(nxt) == 1:
                    return path[path.index(nxt):] + [nxt]
                if not state.get(nxt):
                    state[nxt] = 1
                    path.append(nxt)
                    stack.append(iter(graph.get(nxt, ())))
                    break
            else:
                state[path.pop()] = 2
                stack.pop()
    return None


# ---- (a) no import cycle ----------------------------------------------------

@pytest.mark.parametrize('graph,cycle', [
    ({'a': ['b'], 'b': ['c'], 'c': ['a']}, ['a', 'b', 'c', 'a']),
    ({'a': ['b'], 'b': ['b']}, ['b', 'b']),
    ({'a': ['b', 'c'], 'b': ['d'], 'c': ['d'], 'd': []}, None),
    ({'a': ['x'], 'b': ['c'], 'c': ['d'], 'd': ['b']},
     ['b', 'c', 'd', 'b']),
])
def test_cycle_finder_finds_cycles(graph, cycle):
    assert find_cycle(graph) == cycle


def test_cycle_finder_sees_function_level_and_relative_imports(tmp_path):
    """The old circle (codec imports kernels, kernels imports codec inside
    a function), rebuilt in a scratch package: found."""
    pkg = tmp_path / PACKAGE
    (pkg / 'sub').mkdir(parents=True)
    (pkg / '__init__.py').write_text('')
    (pkg / 'codec.py').write_text('from chainer_vgc import kernels\n')
    (pkg / 'kernels.py').write_text(
        'def f():\n    from chainer_vgc import codec\n')
    (pkg / 'sub' / '__init__.py').write_text('from . import a\n')
    (pkg / 'sub' / 'a.py').write_text('from .b import x\n')
    (pkg / 'sub' / 'b.py').write_text('import chainer_vgc.sub.a as a\n')
    modules = package_modules(str(tmp_path))
    graph = import_graph(modules)
    assert graph['chainer_vgc.kernels'] == ['chainer_vgc.codec']
    assert graph['chainer_vgc.sub'] == ['chainer_vgc.sub.a']
    assert find_cycle({k: v for k, v in graph.items()
                       if 'sub' not in k}) == [
        'chainer_vgc.codec', 'chainer_vgc.kernels', 'chainer_vgc.codec']
    assert find_cycle({k: v for k, v in graph.items() if 'sub.' in k}) == [
        'chainer_vgc.sub.a', 'chainer_vgc.sub.b', 'chainer_vgc.sub.a']


def test_no_import_cycle():
    modules = package_modules()
    assert 'chainer_vgc.codec.message' in modules  # the walk sees packages
    cycle = find_cycle(import_graph(modules))
    assert cycle is None, 'import cycle: ' + ' -> '.join(cycle)


def test_kernels_is_below_codec():
    """kernels.py holds device primitives only: it imports no codec module
    (codec builds on it) and defines no wire-format constant."""
    modules = package_modules()
    graph = import_graph(modules)
    assert not [m for m in graph['chainer_vgc.backends.cuda.kernels']
                if m.startswith('chainer_vgc.codec')]
    tree = parse(modules['chainer_vgc.backends.cuda.kernels'])
    constants = {t.id for n in tree.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name)}
    codec_constants = {t.id for n in parse(
        modules['chainer_vgc.codec.constants']).body
        if isinstance(n, ast.Assign) for t in n.targets}
    assert not constants & codec_constants



def test_the_device_layer_imports_nothing_above_it():
    """``chainer_vgc.backends`` (the array module, the registry, the
    kernels and CuPy checks) is the ground floor: its modules import only
    each other, none of the codec, the engines that write the codec's
    messages, the rules or anything above (issue 50: the GPU compress and
    decode sat in it and imported the codec, an arrow back up)."""
    graph = import_graph(package_modules())
    up = sorted((m, t) for m, targets in graph.items()
                if m.startswith('chainer_vgc.backends')
                for t in targets if not t.startswith('chainer_vgc.backends'))
    assert not up, up
    engines = {t for m, targets in graph.items()
               if m.startswith('chainer_vgc.engines') for t in targets}
    assert 'chainer_vgc.codec' in engines  # (the engines stand above it)

# ---- (b) private names stay private -----------------------------------------

def private_uses(importer, tree, modules):
    """``[(owner module, private name, line)]`` taken by ``importer`` from
    another chainer_vgc module: ``from m import _x`` and ``m._x`` where
    ``m`` is bound by an import of a chainer_vgc module (``import
    chainer_vgc.m``: the chain ``chainer_vgc.m._x``)."""
    found, bound = imports_of(importer, tree, modules)
    uses = []
    for imp in found:
        leaf = imp.target.rpartition('.')[2]
        if imp.name is not None and _is_private(imp.name):
            uses.append((imp.target, imp.name, imp.line))
        elif imp.name is None and _is_private(leaf):  # a private module
            uses.append((imp.target.rpartition('.')[0], leaf, imp.line))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in bound:
            continue
        owner = '.'.join([bound[value.id]] + chain[::-1])
        if owner in modules:
            uses.append((owner, node.attr, node.lineno))
    return uses


def allowed(importer, owner, name, modules):
    """Whether ``importer`` may use ``owner``'s private ``name``: a
    private submodule inside its package; a private name within one
    subpackage (not across the top-level package)."""
    if importer == owner:
        return True
    if owner + '.' + name in modules:  # a private module of package owner
        return importer == owner or importer.startswith(owner + '.')
    shared = package_of(owner, modules)
    return shared != PACKAGE and package_of(importer, modules) == shared


def private_imports(modules):
    out = set()
    for importer, path in modules.items():
        for owner, name, line in private_uses(importer, parse(path),
                                              modules):
            if not allowed(importer, owner, name, modules):
                out.add((importer, owner, name))
    return out


def test_private_name_check_can_fail(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / 'codec').mkdir(parents=True)
    (pkg / '__init__.py').write_text('from chainer_vgc import _hook\n')
    (pkg / '_hook.py').write_text('')
    (pkg / 'codec' / '__init__.py').write_text('')
    (pkg / 'codec' / 'gap.py').write_text('_x = 1\n')
    (pkg / 'codec' / 'message.py').write_text(
        'from chainer_vgc.codec.gap import _x\n')
    (pkg / 'a.py').write_text(
        'from chainer_vgc.codec.gap import _x\n'
        'import chainer_vgc.codec.gap\n'
        'from chainer_vgc import codec as c\n'
        'def f():\n'
        '    return chainer_vgc.codec.gap._y + c._z + c.gap.__name__\n')
    (pkg / 'b.py').write_text('from chainer_vgc.a import _p\n')
    (pkg / 'c.py').write_text('from . import _hook\n')
    modules = package_modules(str(tmp_path))
    assert private_imports(modules) == {
        ('chainer_vgc.a', 'chainer_vgc.codec.gap', '_x'),
        ('chainer_vgc.a', 'chainer_vgc.codec.gap', '_y'),
        ('chainer_vgc.a', 'chainer_vgc.codec', '_z'),
        ('chainer_vgc.b', 'chainer_vgc.a', '_p'),
    }


def test_no_private_imports_between_modules():
    found = private_imports(package_modules())
    new = found - KNOWN_PRIVATE_IMPORTS
    assert not new, 'private names imported from another module: {}'.format(
        sorted(new))
    fixed = KNOWN_PRIVATE_IMPORTS - found
    assert not fixed, 'no longer imported, remove from ' \
        'KNOWN_PRIVATE_IMPORTS: {}'.format(sorted(fixed))


def _scripts():
    for top in ('tests', 'benchmarks', 'examples'):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != '__pycache__']
            for f in filenames:
                if f.endswith('.py'):
                    yield os.path.join(dirpath, f)


def test_scripts_use_no_private_codec_or_kernels_names():
    """Tests, benchmarks and examples use the public names of codec and
    kernels (a helper they need is public in its codec module)."""
    modules = package_modules()
    bad = []
    for path in _scripts():
        for owner, name, line in private_uses('__main__', parse(path),
                                              modules):
            if owner.startswith(('chainer_vgc.codec',
                                 'chainer_vgc.backends.cuda.kernels')):
                bad.append('{}:{}: {}.{}'.format(
                    os.path.relpath(path, ROOT), line, owner, name))
    assert not bad


# ---- (c) module size --------------------------------------------------------

def _line_counts():
    counts = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, PACKAGE)):
        dirnames[:] = [d for d in dirnames if d != '__pycache__']
        for f in filenames:
            if f.endswith('.py'):
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    counts[os.path.relpath(path, ROOT)] = sum(1 for _ in fh)
    return counts


def test_no_module_is_over_the_line_guideline():
    counts = _line_counts()
    over = {p: n for p, n in counts.items() if n > MAX_LINES}
    assert not over, 'modules over {} lines (cut them along a concept): ' \
        '{}'.format(MAX_LINES, over)


# ---- (d) the core imports neither Chainer nor MPI ---------------------------

def test_core_imports_neither_chainer_nor_mpi():
    code = textwrap.dedent('''
        import importlib, json, sys
        forbidden = {!r}
        out = {{}}
        for name in {!r}:
            importlib.import_module(name)
            out[name] = sorted(m for m in sys.modules
                               if m.split('.')[0] in forbidden)
        print(json.dumps(out))
    ''').format(FORBIDDEN, CORE)
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(loaded) == sorted(CORE)
    assert {m: v for m, v in loaded.items() if v} == {}


# ---- (e) packaging ----------------------------------------------------------

def test_setup_cfg_lists_every_package():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, 'setup.cfg'))
    listed = set(cfg.get('options', 'packages').split())
    modules = package_modules()
    packages = {m for m in modules if is_package(m, modules)}
    assert packages <= listed, sorted(packages - listed)


def test_readme_is_a_front_door():
    """README.md: at most 250 lines, opening with the two set-up commands,
    the ChainerMN usage within its first 80 lines."""
    with open(os.path.join(ROOT, 'README.md')) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 250, len(lines)
    first = '\n'.join(lines[:20])
    assert 'make demo' in first and 'make test' in first
    head = '\n'.join(lines[:80])
    for name in ('chainer_vgc.create_communicator',
                 'chainer_vgc.create_multi_node_optimizer'):
        assert name in head, name


def layout_names(page, rel):
    """Whether the layout page names module ``rel`` (a path under
    ``chainer_vgc/``): by its whole path anywhere, or by its file name in
    a table row that names its folder (``chainer_vgc/statistics/``, or a
    path of a file in it): a file name alone counts for that row's
    folders only, so a new ``run.py`` elsewhere needs its own mention."""
    if '`chainer_vgc/{}`'.format(rel) in page:
        return True
    folder, name = os.path.split(rel)
    want = 'chainer_vgc/' + (folder + '/' if folder else '')
    for line in page.splitlines():
        if not line.startswith('|'):
            continue
        tokens = line.split('`')[1::2]
        folders = {t for t in tokens if t.startswith('chainer_vgc/')
                   and t.endswith('/')}
        folders.update(t.rpartition('/')[0] + '/' for t in tokens
                       if t.startswith('chainer_vgc/') and t.endswith('.py'))
        if want in folders and name in tokens:
            return True
    return False


def test_the_layout_check_matches_paths():
    page = ('| stats | `hook.py`, `run.py` | `chainer_vgc/statistics/` |\n'
            '| api | `chainer_vgc/__init__.py`, `factory.py` | |\n'
            'prose naming `gap.py` and `chainer_vgc/codec/raw.py`\n')
    assert layout_names(page, 'statistics/run.py')
    assert layout_names(page, 'factory.py')
    assert layout_names(page, 'codec/raw.py')
    assert not layout_names(page, 'exchange/run.py')
    assert not layout_names(page, 'codec/gap.py')
    assert not layout_names(page, 'statistics/factory.py')
    assert not layout_names(page, 'hook.py')


def test_the_layout_page_names_every_module():
    """docs/layout.md, the newcomer's map, names every module of the
    package by its path (:func:`layout_names`; a package's
    ``__init__.py`` is named by its folder): a module added without a row
    there fails here."""
    root = os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), 'chainer_vgc')
    with open(os.path.join(os.path.dirname(root), 'docs', 'layout.md')) as f:
        page = f.read()
    missing = []
    for folder, _, files in os.walk(root):
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), root)
            if not name.endswith('.py') or name == '__init__.py':
                continue
            if not layout_names(page, rel):
                missing.append(rel)
    assert not missing, 'docs/layout.md does not name: {}'.format(
        ', '.join(sorted(missing)))


# ---- no private attribute of another package's objects ----------------------

def unit_of(name, modules):
    """What owns a module's private attributes: its subpackage
    (``chainer_vgc.exchange`` for ``chainer_vgc.exchange.mean``), or the
    module itself at the top level (``chainer_vgc.compressor``)."""
    parts = name.split('.')
    if len(parts) > 2 or (len(parts) == 2 and is_package(name, modules)):
        return '.'.join(parts[:2])
    return name


_ATTR_CALLS = ('getattr', 'setattr', 'hasattr', 'delattr')


def _own(value):
    return isinstance(value, ast.Name) and value.id in ('self', 'cls')


def private_attributes(modules):
    """{private attribute name: the units whose classes define it}:
    ``self._x = ...`` (or ``cls._x``) in a method, ``getattr(self, '_x',
    ...)`` and its kin, or ``_x`` bound in a class body (a method, a class
    attribute)."""
    owners = {}
    for name, path in modules.items():
        unit = unit_of(name, modules)
        for node in ast.walk(parse(path)):
            found = []
            if (isinstance(node, ast.Attribute) and _own(node.value) and
                    isinstance(node.ctx, ast.Store)):
                found.append(node.attr)
            elif (isinstance(node, ast.Call) and
                  isinstance(node.func, ast.Name) and
                  node.func.id in _ATTR_CALLS and len(node.args) >= 2 and
                  _own(node.args[0]) and
                  isinstance(node.args[1], ast.Constant) and
                  isinstance(node.args[1].value, str)):
                found.append(node.args[1].value)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.ClassDef)):
                        found.append(item.name)
                    elif isinstance(item, ast.Assign):
                        found.extend(t.id for t in item.targets
                                     if isinstance(t, ast.Name))
            for attr in found:
                if _is_private(attr):
                    owners.setdefault(attr, set()).add(unit)
    return owners


def reached_attributes(modules):
    """``{(module, attribute, line)}``: a private attribute that a class of
    another unit defines, read, set or deleted on an object that is not
    ``self`` or ``cls`` (``obj._x``, or ``getattr(obj, '_x')`` and its
    kin, by a literal name), by a module whose unit does not define one
    of that name too (names, not types: a heuristic that misses a reach
    whose name both units use, and no false alarm on Chainer's own
    private attributes, which no class here defines)."""
    owners = private_attributes(modules)
    out = set()
    for name, path in modules.items():
        unit = unit_of(name, modules)
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Attribute) and not _own(node.value):
                attr = node.attr
            elif (isinstance(node, ast.Call) and
                  isinstance(node.func, ast.Name) and
                  node.func.id in _ATTR_CALLS and len(node.args) >= 2 and
                  not _own(node.args[0]) and
                  isinstance(node.args[1], ast.Constant) and
                  isinstance(node.args[1].value, str)):
                attr = node.args[1].value
            else:
                continue
            if attr in owners and unit not in owners[attr]:
                out.add((name, attr, node.lineno))
    return out


def test_reached_attribute_check_can_fail(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / 'backends').mkdir(parents=True)
    (pkg / '__init__.py').write_text('')
    (pkg / 'backends' / '__init__.py').write_text('')
    (pkg / 'comp.py').write_text(
        'class C(object):\n'
        '    _kind = 1\n'
        '    def __init__(self):\n'
        '        self._step = None\n'
        '    def _helper(self):\n'
        '        return self._step\n')
    (pkg / 'backends' / 'steps.py').write_text(
        'def find(c, fn):\n'
        '    c._step = fn._chainer_private\n'
        '    getattr(c, "_kind")\n'
        '    setattr(c, "_step", None)\n'
        '    return c._helper()\n')
    (pkg / 'backends' / 'other.py').write_text(
        'class D(object):\n'
        '    def run(self):\n'
        '        self._step = 2\n'
        '        return self._kind\n')
    (pkg / 'backends' / 'more.py').write_text(
        'def g(d):\n'
        '    return d._step\n')
    modules = package_modules(str(tmp_path))
    assert reached_attributes(modules) == {
        ('chainer_vgc.backends.steps', '_kind', 3),
        ('chainer_vgc.backends.steps', '_helper', 5),
    }  # (not c._step: a class of backends defines one of that name too)


def test_no_module_reaches_another_packages_private_attributes():
    """The GPU engine's buffers are its own (``step``, ``staging``), a
    duplicate's finalizer is set through
    ``Collectives.free_when_collected``: no module reads or sets a private
    attribute that a class of another subpackage (or top-level module)
    defines."""
    found = reached_attributes(package_modules())
    assert not found, 'private attributes of another package: {}'.format(
        sorted(found))
