"""Keep `import torch._dynamo` (3-4 s on a 2-core CPU, the largest item of a rank's start-up
after `import torch`) out of stages that do not compile.

torch marks its optimizers, DistributedDataParallel and dispatch modes "not to be traced by
torch.compile" with `torch._disable_dynamo`, which imports torch._dynamo on the first call
only to wrap the function in `torch._dynamo.disable`; the optimizers' step calls
`torch._dynamo.graph_break()` (a no-op outside tracing), DDP asks which DDP mode dynamo
would use, init_process_group clears dynamo's trace-rule caches (empty while it was never
imported), and `import torchvision` imports `torch._dynamo.utils.is_compile_supported`
(2.3 s of its 2.6 s here). A stage that never compiles never traces, so none of this changes
what runs. `defer()` puts stand-ins for torch._dynamo and torch._dynamo.utils in their place
that answer exactly these as the real ones do outside tracing (is_compile_supported by
asking the real one, when it is called); the first use of anything else (torch.compile in
a user's model builder, say) imports the real torch._dynamo and hands over to it.

That depends on torch's internals, so `defer()` first reads the installed torch's files at
those points (SERVED: their text, about 2 ms, nothing imported) for what they use of
torch._dynamo; a name the stand-in lacks, a call it would not accept, or a failed install
leaves torch._dynamo to the real import (seconds of start-up, the same results) and says
so once (rank 0).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import re
import sys
import types
from pathlib import Path

NAME = "torch._dynamo"
UTILS = NAME + ".utils"
# where a stage that does not compile reaches torch._dynamo: (package, file in it)
SERVED = (("torch", "_compile.py"), ("torch", "optim/optimizer.py"),
          ("torch", "nn/parallel/distributed.py"), ("torch", "distributed/distributed_c10d.py"),
          ("torchvision", "ops/roi_align.py"))
# used there only when DDP's mode is python_reducer, which the stand-in's answer rules out
AFTER_REAL = ("trace_rules.LEGACY_MOD_INLINELIST", "trace_rules.get_legacy_mod_inlinelist")
_USE = re.compile(r"torch\._dynamo((?:\.[A-Za-z_]\w*)+)(\(([^()]*)\))?")
_FROM = re.compile(r"from torch\._dynamo((?:\.\w+)*) import (?:\(([^)]*)\)|([\w ,]+))")
_said: list[str] = []  # the fall-back's line, once a process


def _disable(fn=None, recursive=True, *, wrapping=True, reason=None):  # noqa: ARG001
    return fn if fn is not None else (lambda f: f)


def _graph_break(msg: str = "") -> None:  # noqa: ARG001
    return None


def _real(attr: str, name: str = NAME):
    """The first use of anything else: the real modules, from then on."""
    for standin in (UTILS, NAME):
        if isinstance(sys.modules.get(standin), _Standin):
            del sys.modules[standin]
    return getattr(importlib.import_module(name), attr)


def _is_compile_supported(device_type) -> bool:
    return _real("is_compile_supported", UTILS)(device_type)


class _Standin(types.ModuleType):
    def __getattr__(self, attr: str):
        # `import torch._dynamo.X` asks the package for __path__; utils is a plain module
        # (`from torch._dynamo.utils import f` asks it too, and must get no answer)
        if attr.startswith("__") and attr.endswith("__") and (
                attr != "__path__" or self.__name__ == UTILS):
            raise AttributeError(attr)
        return _real(attr, self.__name__)


class _Loaded(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import torch._dynamo.X` while the stand-in was in place: the import system has just
    swapped in the real package (asking the stand-in for __path__), whose import loaded X:
    hand the import system that module instead of letting it load a second copy."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith(NAME + ".") and name in sys.modules and not deferred():
            return importlib.machinery.ModuleSpec(name, self)
        return None  # not loaded yet: the usual finders load it, as the real package's child

    def create_module(self, spec):
        return sys.modules[spec.name]

    def exec_module(self, module):
        pass


def defer() -> bool:
    """Install the stand-in unless torch._dynamo is loaded already, or the stand-in does not
    fit the installed torch (said once); True if installed."""
    if NAME in sys.modules:
        return False
    standin = _standin()
    try:
        problems = mismatches(standin)
    except Exception as e:  # noqa: BLE001 - unchecked, the stand-in is not used
        problems = [f"its check failed ({type(e).__name__}: {e})"]
    if not problems:
        try:
            _install(standin)
            return True
        except Exception as e:  # noqa: BLE001 - whatever it was, torch imports its own
            _uninstall()
            problems = [f"installing it failed ({type(e).__name__}: {e})"]
    _say_once(problems)
    return False


def _standin() -> _Standin:
    standin = _Standin(NAME, __doc__)
    standin.disable = _disable
    standin.graph_break = _graph_break
    # init_process_group: nothing is cached while the real module was never imported
    standin.trace_rules = types.SimpleNamespace(clear_lru_cache=lambda: None)
    utils = _Standin(UTILS)
    utils.is_compile_supported = _is_compile_supported  # torchvision.ops imports it
    # DDP's constructor: dynamo's default optimize_ddp mode (what it returns untraced)
    utils.get_optimize_ddp_mode = lambda: "ddp_optimizer"
    standin.utils = utils
    return standin


def _install(standin: _Standin) -> None:
    if not any(isinstance(f, _Loaded) for f in sys.meta_path):
        sys.meta_path.insert(0, _Loaded())
    sys.modules[NAME], sys.modules[UTILS] = standin, standin.utils


def _uninstall() -> None:
    for name in (UTILS, NAME):
        if isinstance(sys.modules.get(name), _Standin):
            del sys.modules[name]


def mismatches(standin: _Standin | None = None, served=None) -> list[str]:
    """What the installed torch uses of torch._dynamo at the served points (SERVED) and the
    stand-in does not provide, or would not accept as called; [] when it fits."""
    standin = standin or _standin()
    problems = []
    for package, rel in SERVED if served is None else served:
        spec = importlib.util.find_spec(package)  # a top-level package: not imported
        if spec is None or not spec.origin:
            if package == "torch":
                problems.append(f"torch has no {rel}")
            continue  # no torchvision: nothing of it to serve
        path = Path(spec.origin).parent / rel
        if not path.is_file():
            problems.append(f"{package} has no {rel}: the stand-in serves it")
            continue
        for chain, args in uses(path.read_text(encoding="utf-8")):
            if chain.startswith(AFTER_REAL):
                continue
            found = _resolve(standin, chain)
            where = f"{package}/{rel} uses torch._dynamo.{chain}"
            if found is None:
                problems.append(f"{where}, which the stand-in lacks")
            elif args is not None and not _accepts(found, args):
                problems.append(f"{where}({args}), which the stand-in does not accept")
    return problems


def uses(text: str) -> list[tuple[str, str | None]]:
    """(attribute chain under torch._dynamo, a call's argument text or None) in a source."""
    found = [(m.group(1)[1:], m.group(3)) for m in _USE.finditer(text)]
    for m in _FROM.finditer(text):
        found += [((m.group(1)[1:] + "." if m.group(1) else "") + n.split()[0], None)
                  for n in (m.group(2) or m.group(3)).split(",") if n.strip()]
    return found


def _resolve(standin, chain: str):
    """The stand-in's own object at chain (never the hand-over to the real module)."""
    obj = standin
    for part in chain.split("."):
        if isinstance(obj, (types.ModuleType, types.SimpleNamespace)):
            obj = vars(obj).get(part)
        else:  # an attribute of a served object (a function's cache_clear, say)
            obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _accepts(fn, args: str) -> bool:
    """Whether fn takes a call with this argument text (its names and their number)."""
    parts = [a.strip() for a in args.split(",") if a.strip()]
    if not callable(fn) or any(a.startswith("*") for a in parts):
        return callable(fn)
    named = [m.group(1) for a in parts if (m := re.match(r"(\w+)\s*=(?!=)", a))]
    try:
        inspect.signature(fn).bind(*[None] * (len(parts) - len(named)),
                                   **dict.fromkeys(named))
    except TypeError:
        return False
    return True


def _say_once(problems: list[str]) -> None:
    if _said or os.environ.get("RANK", "0") != "0":  # one line a run, not one a rank
        _said.append(problems[0])
        return
    _said.append(problems[0])
    import torch

    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    print(f"ddpflow: warning: torch._dynamo is imported as usual (seconds of start-up): "
          f"the start-up stand-in does not fit torch {torch.__version__}: "
          f"{problems[0]}{more}", file=sys.stderr)


def deferred() -> bool:
    """Whether the stand-in is still in place (the real module was never needed)."""
    return isinstance(sys.modules.get(NAME), _Standin)
