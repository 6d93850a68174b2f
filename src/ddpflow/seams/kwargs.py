"""`model.kwargs` against the builder they go to: part of the seam contract (contract.py),
for the built-ins (smallcnn, mlp), torchvision and timm as for the user's builder.

- what ddpflow passes itself (the class count, the input channels) is not taken twice:
  `kwargs: {num_classes: 3}` on a built-in is one message, not a TypeError;
- pretrained weights come only through `model.weights` (a file, or a torchvision weights
  name found in the local torch hub cache): `weights` / `pretrained` in kwargs would make
  torchvision or timm download them, which ddpflow never does;
- a key the builder's signature does not take is one message naming it and what it takes;
  a builder with **kwargs passes them on, and a class that does not take one is named from
  the TypeError it raises (`unexpected_keyword`).
"""

from __future__ import annotations

import difflib
import inspect
import re
from typing import Callable

from ddpflow.core.errors import UserError, short

# the kwargs that download or load weights by themselves, per kind of builder
WEIGHT_KEYS = {"builtin": ("weights", "pretrained"),
               "torchvision": ("weights", "pretrained", "progress"),
               "timm": ("pretrained", "pretrained_cfg", "pretrained_cfg_overlay",
                        "checkpoint_path", "weights")}
# what ddpflow passes to each kind of builder itself (from the data)
PASSED = {"builtin": ("num_classes", "in_channels"), "torchvision": ("num_classes",),
          "timm": ("num_classes", "in_chans")}
UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")


def takes(fn: Callable) -> tuple[list[str], bool]:
    """(the keyword names fn takes, whether it takes **kwargs); a callable without a
    signature takes anything."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return [], True
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def check_kwargs(kwargs: dict, kind: str, name: str, fn: Callable | None = None) -> None:
    """model.kwargs of model `name` (a builder of `kind`: builtin | torchvision | timm |
    user) before the builder `fn` is called: one UserError for a key it must not take."""
    for key in kwargs:
        if key in WEIGHT_KEYS.get(kind, ()):
            raise UserError(f"model.kwargs.{key}: pretrained weights come through "
                            f"model.weights (a file, or a torchvision weights name such as "
                            f"DEFAULT from the local torch hub cache), never through the "
                            f"builder, which would download them; remove model.kwargs.{key}")
        if key in PASSED.get(kind, ()):
            raise UserError(f"model.kwargs.{key}: ddpflow passes {key} to {name} itself, "
                            f"from the prepared data; remove it from model.kwargs (the "
                            f"data's class count and channels are what the model must fit)")
    if fn is None:
        return
    names, any_key = takes(fn)
    if any_key:
        return
    for key in kwargs:
        if key not in names:
            raise UserError(unknown_key(key, name, names))


def unknown_key(key, name: str, names: list[str]) -> str:
    """The message for a key `name`'s builder (taking `names`) does not take."""
    shown = key if isinstance(key, str) and key.isidentifier() else short(key, 40)
    close = difflib.get_close_matches(str(key), names, n=1)
    offered = [n for n in names if n not in ("self", "num_classes", "in_channels")]
    return (f"model.kwargs.{shown}: {name} takes no argument {shown}"
            + (f" (did you mean '{close[0]}'?)" if close else "")
            + (f"; it takes {', '.join(offered)}" if offered else "; it takes none"))


def unexpected_keyword(err: BaseException, kwargs: dict, name: str) -> UserError | None:
    """The error of a builder that passed **kwargs on to a class that does not take one of
    model.kwargs (a TypeError, or `call`'s UserError quoting it), as one message naming the
    key; None for any other error."""
    m = UNEXPECTED.search(str(err))
    if not m or m.group(1) not in kwargs:
        return None
    return UserError(f"model.kwargs.{m.group(1)}: {name} takes no argument {m.group(1)} "
                     f"(its builder passes model.kwargs on, and {m.group(0)} was raised); "
                     f"remove it or check its spelling")
