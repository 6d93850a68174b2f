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
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

NAME = "torch._dynamo"
UTILS = NAME + ".utils"


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
    """Install the stand-in unless torch._dynamo is loaded already; True if installed."""
    if NAME in sys.modules:
        return False
    if not any(isinstance(f, _Loaded) for f in sys.meta_path):
        sys.meta_path.insert(0, _Loaded())
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
    sys.modules[NAME], sys.modules[UTILS] = standin, utils
    return True


def deferred() -> bool:
    """Whether the stand-in is still in place (the real module was never needed)."""
    return isinstance(sys.modules.get(NAME), _Standin)
