"""Keep `import torch._dynamo` (3-4 s on a 2-core CPU, the largest item of a rank's start-up
after `import torch`) out of stages that do not compile.

torch marks its optimizers, DistributedDataParallel and dispatch modes "not to be traced by
torch.compile" with `torch._disable_dynamo`, which imports torch._dynamo on the first call
only to wrap the function in `torch._dynamo.disable`; the optimizers' step calls
`torch._dynamo.graph_break()` (a no-op outside tracing) and DDP asks which DDP mode dynamo
would use. A stage that never compiles never traces, so none of this changes what runs.
`defer()` puts a stand-in module in its place that answers exactly these three as the real
one does outside tracing; the first use of anything else (torch.compile in a user's model
builder, say) imports the real torch._dynamo and hands over to it.
"""

from __future__ import annotations

import importlib
import sys
import types

NAME = "torch._dynamo"


def _disable(fn=None, recursive=True, *, wrapping=True, reason=None):  # noqa: ARG001
    return fn if fn is not None else (lambda f: f)


def _graph_break(msg: str = "") -> None:  # noqa: ARG001
    return None


def _real(attr: str):
    """The first use of anything but `disable`: the real module, from then on."""
    if isinstance(sys.modules.get(NAME), _Standin):
        del sys.modules[NAME]
    return getattr(importlib.import_module(NAME), attr)


class _Standin(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _real(attr)


def defer() -> bool:
    """Install the stand-in unless torch._dynamo is loaded already; True if installed."""
    if NAME in sys.modules:
        return False
    standin = _Standin(NAME, __doc__)
    standin.disable = _disable
    standin.graph_break = _graph_break
    # DDP's constructor: dynamo's default optimize_ddp mode (what it returns untraced)
    standin.utils = types.SimpleNamespace(get_optimize_ddp_mode=lambda: "ddp_optimizer")
    sys.modules[NAME] = standin
    return True


def deferred() -> bool:
    """Whether the stand-in is still in place (the real module was never needed)."""
    return isinstance(sys.modules.get(NAME), _Standin)
