"""Every mutant of a module, compiled into one copy of it (mutation schemata).

A mutant is one small change a developer could make by mistake. Instead of writing one file
per mutant, each site becomes a switch: `(<mutant> if _mut_(17) else <original>)` for an
expression, `if _mut_(18): pass / else: <statement>` for a removed statement. The copy runs
the original code unless the process was started with DDPFLOW_MUTANT=17 (tests/mutation/
switch.py), so every process a test starts (torchrun ranks, Snakemake's `ddpflow` calls, a
Slurm job) runs the same mutant, and one copy of the package serves every mutant.

Only function bodies are mutated (not default arguments, decorators, annotations or module
level code: those run at import, before a forked test process picks its mutant). A mutant
belongs to the innermost function around it; a function's identity for the ratchet is its
qualified name and the hash of its syntax tree without nested functions (comments and
formatting do not change it; tests/mutation/records.json keeps results per hash).

Operators (OPERATORS, the names used in the records):
    compare     a comparison to its boundary neighbour and to its negation (< -> <=, >=)
    boolean     and <-> or; a `not` removed; True <-> False
    constant    an integer +1 and -1; a float doubled (0.0 -> 1.0)
    arithmetic  + <-> -, * <-> /, // -> /, % -> *, ** -> *; the same for `x += ...`
    minmax      min <-> max, any <-> all
    return      `return X` -> `return None`
    statement   a call statement, `raise`, `continue`, `break` or `x += ...` removed
    handler     an `except` clause made to re-raise (as if it were not there)
    message     the text of an exception (or UserError) emptied; an f-string with its
                first field left out
"""

from __future__ import annotations

import ast
import copy
import hashlib
from dataclasses import dataclass

VERSION = "1"  # bump when an operator changes: every record is then stale
SWITCH = "_mut_"  # the name the copy calls (from _ddpflow_mutant import hit as _mut_)

CMP = {ast.Lt: (ast.LtE, ast.GtE), ast.LtE: (ast.Lt, ast.Gt), ast.Gt: (ast.GtE, ast.LtE),
       ast.GtE: (ast.Gt, ast.Lt), ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,),
       ast.Is: (ast.IsNot,), ast.IsNot: (ast.Is,), ast.In: (ast.NotIn,), ast.NotIn: (ast.In,)}
ARITH = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
         ast.FloorDiv: ast.Div, ast.Mod: ast.Mult, ast.Pow: ast.Mult}
SYM = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
       ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.Add: "+",
       ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
       ast.Pow: "**"}
SWAP_NAMES = {"min": "max", "max": "min", "any": "all", "all": "any"}
OPERATORS = ("compare", "boolean", "constant", "arithmetic", "minmax", "return", "statement",
             "handler", "message")


@dataclass
class Mutant:
    function: str  # "engine/checkpoint.py::latest_valid"
    ordinal: int  # its place among the function's mutants (stable while the hash is)
    op: str  # one of OPERATORS
    what: str  # "< -> <=", "statement removed", ...
    line: int  # in the module
    before: str  # the original source of the site
    after: str  # what the mutant puts there
    id: int = 0  # the switch number in this build (not stable across builds)
    line_before: str = ""  # the whole source line of a one-line site, and as mutated
    line_after: str = ""

    def describe(self) -> str:
        return f"{self.function}:{self.line} {self.what}"


@dataclass
class _Site:
    path: tuple  # from the module node: (field, index or None), ...
    function: str
    op: str
    what: str
    kind: str  # "expr" (replace the node), "stmt" (remove it), "handler" (re-raise)
    make: object  # node -> mutated node (expr); None otherwise
    node: ast.AST  # the pristine node


def _is_error_name(func: ast.AST) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name.endswith(("Error", "Exception", "Exit")) or name == "UserError"


def _docstring(body: list) -> ast.AST | None:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0]
    return None


def _child_paths(node: ast.AST):
    for field, value in ast.iter_fields(node):
        if isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, ast.AST):
                    yield (field, i), item
        elif isinstance(value, ast.AST):
            yield (field, None), value


SKIP_FIELDS = {"annotation", "returns", "decorator_list", "type_comment"}


class _Finder:
    """Walks the pristine module; the sites of each function body in source order."""

    def __init__(self, module: str, source: str):
        self.module, self.source = module, source
        self.sites: list[_Site] = []
        self.functions: dict[str, ast.AST] = {}  # qualname -> def node

    def run(self, tree: ast.Module) -> None:
        self._scope(tree, (), [])

    def _scope(self, node, path, names):
        """Statements outside functions: look for defs only (module level, class bodies)."""
        for sub, child in _child_paths(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._function(child, path + (sub,), names + [child.name])
            elif isinstance(child, ast.ClassDef):
                self._scope(child, path + (sub,), names + [child.name])
            elif isinstance(child, ast.stmt):
                self._scope(child, path + (sub,), names)

    def _function(self, func, path, names):
        qual = ".".join(names)
        key = qual
        n = 2
        while f"{self.module}::{key}" in self.functions:
            key, n = f"{qual}#{n}", n + 1
        fname = f"{self.module}::{key}"
        self.functions[fname] = func
        doc = _docstring(func.body)
        for i, stmt in enumerate(func.body):
            if stmt is not doc:
                self._node(stmt, path + (("body", i),), fname, names, in_fstring=False)

    def _node(self, node, path, fname, names, in_fstring):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self._function(node, path, names + [node.name])
            return
        if isinstance(node, ast.ClassDef):
            self._scope(node, path, names + [node.name])
            return
        if not in_fstring:
            self._sites_of(node, path, fname)
        inside = in_fstring or isinstance(node, ast.JoinedStr)
        for sub, child in _child_paths(node):
            if sub[0] in SKIP_FIELDS:
                continue
            self._node(child, path + (sub,), fname, names, inside)

    def _add(self, path, fname, op, what, kind, make, node):
        self.sites.append(_Site(path, fname, op, what, kind, make, node))

    def _sites_of(self, node, path, fname):
        add = self._add
        ctx = getattr(node, "ctx", None)
        if ctx is not None and not isinstance(ctx, ast.Load):
            return
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                for new in CMP.get(type(op), ()):
                    def make(n, i=i, new=new):
                        m = copy.copy(n)
                        m.ops = list(n.ops)
                        m.ops[i] = new()
                        return m
                    add(path, fname, "compare", f"{SYM[type(op)]} -> {SYM[new]}", "expr",
                        make, node)
        elif isinstance(node, ast.BoolOp):
            new = ast.Or if isinstance(node.op, ast.And) else ast.And
            word = "and -> or" if isinstance(node.op, ast.And) else "or -> and"

            def make(n, new=new):
                m = copy.copy(n)
                m.op = new()
                return m
            add(path, fname, "boolean", word, "expr", make, node)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            add(path, fname, "boolean", "not removed", "expr", lambda n: n.operand, node)
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            add(path, fname, "boolean", f"{node.value} -> {not node.value}", "expr",
                lambda n: ast.Constant(not n.value), node)
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            for d in (1, -1):
                add(path, fname, "constant", f"{node.value} -> {node.value + d}", "expr",
                    lambda n, d=d: ast.Constant(n.value + d), node)
        elif isinstance(node, ast.Constant) and type(node.value) is float:
            new = node.value * 2 if node.value else 1.0
            add(path, fname, "constant", f"{node.value!r} -> {new!r}", "expr",
                lambda n, new=new: ast.Constant(new), node)
        elif isinstance(node, ast.BinOp) and type(node.op) in ARITH:
            new = ARITH[type(node.op)]

            def make(n, new=new):
                m = copy.copy(n)
                m.op = new()
                return m
            add(path, fname, "arithmetic", f"{SYM[type(node.op)]} -> {SYM[new]}", "expr",
                make, node)
        elif isinstance(node, ast.AugAssign) and type(node.op) in ARITH:
            new = ARITH[type(node.op)]

            def make(n, new=new):
                m = copy.copy(n)
                m.op = new()
                return m
            add(path, fname, "arithmetic", f"{SYM[type(node.op)]}= -> {SYM[new]}=", "stmt-swap",
                make, node)
            add(path, fname, "statement", "statement removed", "stmt", None, node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in SWAP_NAMES:
            new = SWAP_NAMES[node.func.id]

            def make(n, new=new):
                m = copy.copy(n)
                m.func = ast.Name(new, ast.Load())
                return m
            add(path, fname, "minmax", f"{node.func.id} -> {new}", "expr", make, node)
        elif isinstance(node, ast.Return) and node.value is not None \
                and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            add(path + (("value", None),), fname, "return", "return X -> return None", "expr",
                lambda n: ast.Constant(None), node.value)
        elif isinstance(node, ast.Expr) and isinstance(node.value, (ast.Call, ast.Await)):
            add(path, fname, "statement", "call removed", "stmt", None, node)
        elif isinstance(node, (ast.Raise, ast.Continue, ast.Break)):
            add(path, fname, "statement", f"{type(node).__name__.lower()} removed", "stmt",
                None, node)
        elif isinstance(node, ast.ExceptHandler):
            add(path, fname, "handler", "except re-raises", "handler", None, node)
        if isinstance(node, ast.Call) and _is_error_name(node.func) and node.args \
                and isinstance(node.args[0], (ast.Constant, ast.JoinedStr, ast.BinOp)):
            arg = node.args[0]
            if not (isinstance(arg, ast.Constant) and arg.value == ""):
                add(path + (("args", 0),), fname, "message", "message emptied", "expr",
                    lambda n: ast.Constant(""), arg)
        if isinstance(node, ast.JoinedStr):
            fields = [i for i, v in enumerate(node.values) if isinstance(v, ast.FormattedValue)]
            if fields:
                def make(n, i=fields[0]):
                    m = copy.copy(n)
                    m.values = n.values[:i] + n.values[i + 1:]
                    return m
                add(path, fname, "message", "f-string's first field left out", "expr", make,
                    node)


def _get(tree, path):
    node = tree
    for field, index in path:
        node = getattr(node, field)
        if index is not None:
            node = node[index]
    return node


def _set(tree, path, new):
    parent = _get(tree, path[:-1])
    field, index = path[-1]
    if index is None:
        setattr(parent, field, new)
    else:
        getattr(parent, field)[index] = new


def _switch(mid: int) -> ast.expr:
    return ast.Call(ast.Name(SWITCH, ast.Load()), [ast.Constant(mid)], [])


def _nested_defs_out(func: ast.AST) -> ast.AST:
    """The function without the bodies of the functions and classes inside it."""
    func = copy.deepcopy(func)
    for node in ast.walk(func):
        for field in ("body", "orelse", "finalbody", "handlers"):
            items = getattr(node, field, None)
            if isinstance(items, list):
                setattr(node, field, [
                    ast.Expr(ast.Constant(f"def {s.name}"))
                    if s is not func and isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                       ast.ClassDef)) else s
                    for s in items])
    return func


def function_hash(func: ast.AST) -> str:
    text = VERSION + ast.dump(_nested_defs_out(func), include_attributes=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _segment(source: str, node: ast.AST) -> str:
    text = ast.get_source_segment(source, node) or ast.unparse(node)
    return " ".join(text.split())


def _describe(site: _Site, source: str) -> tuple[str, str]:
    node = site.node
    if site.kind == "stmt":
        return _segment(source, node), "pass"
    if site.kind == "handler":
        head = source.splitlines()[node.lineno - 1].strip()
        return head, head + " raise"
    mutated = site.make(copy.deepcopy(node))
    before = _segment(source, node)
    if site.kind == "stmt-swap":
        return before, ast.unparse(mutated)
    return before, " ".join(ast.unparse(mutated).split())


def _line_diff(site: _Site, source: str, after: str) -> tuple[str, str]:
    """(the source line, the line as the mutant has it) for a site on one line."""
    node = site.node
    if site.kind == "handler" or node.lineno != node.end_lineno:
        return "", ""
    line = source.splitlines()[node.lineno - 1]
    raw = line.encode()
    start = raw[:node.col_offset].decode()
    if site.kind == "stmt":
        return line.rstrip(), (start + "pass").rstrip()
    rest = raw[node.end_col_offset:].decode()
    return line.rstrip(), (start + after + rest).rstrip()


def mutate_module(module: str, source: str, first_id: int = 1) \
        -> tuple[str, list[Mutant], dict[str, str]]:
    """(the module's source with every mutant switched in, its mutants numbered from
    first_id, {function: hash})."""
    pristine = ast.parse(source)
    finder = _Finder(module, source)
    finder.run(pristine)
    hashes = {name: function_hash(f) for name, f in finder.functions.items()}
    ordinals: dict[str, int] = {}
    mutants: list[tuple[_Site, Mutant]] = []
    for site in finder.sites:  # source order within a function: the ordinal
        k = ordinals.get(site.function, 0)
        ordinals[site.function] = k + 1
        before, after = _describe(site, source)
        lb, la = _line_diff(site, source, after)
        mutants.append((site, Mutant(site.function, k, site.op, site.what,
                                     site.node.lineno, before, after,
                                     first_id + len(mutants), lb, la)))
    work = ast.parse(source)
    # deepest first: a node is wrapped after everything inside it, so the paths of the
    # pristine tree still lead to it; several mutants of one node nest
    by_path: dict[tuple, list[tuple[_Site, Mutant]]] = {}
    for site, m in mutants:
        by_path.setdefault((site.path, site.kind == "handler"), []).append((site, m))
    for (path, _h), group in sorted(by_path.items(), key=lambda kv: -len(kv[0][0])):
        node = _get(work, path)
        kind = group[0][0].kind
        if kind == "handler":
            for _site, m in group:
                node.body.insert(0, ast.If(_switch(m.id), [ast.Raise()], []))
            continue
        if kind in ("stmt", "stmt-swap"):
            new = node
            for site, m in reversed(group):
                body = [site.make(copy.deepcopy(node))] if site.kind == "stmt-swap" \
                    else [ast.Pass()]
                new = ast.If(_switch(m.id), body, [new])
            _set(work, path, new)
            continue
        new = node
        for site, m in reversed(group):
            new = ast.IfExp(_switch(m.id), site.make(copy.deepcopy(node)), new)
        _set(work, path, new)
    _import_switch(work)
    ast.fix_missing_locations(work)
    return ast.unparse(work) + "\n", [m for _s, m in mutants], hashes


def _import_switch(tree: ast.Module) -> None:
    at = 0
    body = tree.body
    if _docstring(body) is not None:
        at = 1
    while at < len(body) and isinstance(body[at], ast.ImportFrom) \
            and body[at].module == "__future__":
        at += 1
    body.insert(at, ast.ImportFrom("_ddpflow_mutant", [ast.alias("hit", SWITCH)], 0))
