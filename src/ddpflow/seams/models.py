"""The model builder seam: `model.name` is a built-in (`smallcnn`, `mlp`), a torchvision
classifier, `timm:NAME` (the optional timm extra) or the user's `package.module:callable`.
Built-ins and user builders are called the same way: `model.kwargs` plus `num_classes` and
`in_channels` where the callable takes them, and checked by the one seam contract
(contract.py) when given a probe."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from ddpflow.core.errors import UserError, short
from ddpflow.seams import kwargs
from ddpflow.seams.contract import Probe, check_model
from ddpflow.seams.userimport import add_code_dir, call, is_import_path, load_callable


class SmallCNN(nn.Module):
    """Three conv blocks and a linear head; learns the synthetic set in a few CPU epochs."""

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 32):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

        self.features = nn.Sequential(
            block(in_channels, width), nn.MaxPool2d(2),
            block(width, 2 * width), nn.MaxPool2d(2),
            block(2 * width, 4 * width), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        return self.head(self.features(x))


class MLP(nn.Module):
    """Two linear layers on the image pooled to 8 x 8, no BatchNorm: a baseline, and the
    model for tests that need a loss that is exactly a mean over samples (no batch
    statistics)."""

    def __init__(self, num_classes: int, in_channels: int = 3, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.AdaptiveAvgPool2d(8), nn.Flatten(),
                                 nn.Linear(in_channels * 64, hidden), nn.ReLU(inplace=True),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x)


BUILTIN = {"smallcnn": SmallCNN, "mlp": MLP}


def kind(name: str) -> str:
    """builtin | torchvision | timm | user: which builder a model.name goes to."""
    if name in BUILTIN:
        return "builtin"
    if name.startswith("timm:"):
        return "timm"
    return "user" if is_import_path(name) else "torchvision"


def input_channels(name: str, data_channels: int) -> int:
    """Channels the model takes: torchvision models want 3, the others adapt to the data."""
    return 3 if kind(name) == "torchvision" else data_channels


def build_model(mc, num_classes: int | None, data_channels: int | None,
                probe: Probe | None = None) -> nn.Module:
    """The model that model config `mc` (or a bare name) names, freshly initialised; weights
    come later (weights.py). With a probe (contract.probe(cfg, meta)) one forward of 2 probe
    images checks its outputs (contract.check_model): on the meta device, shapes only."""
    if isinstance(mc, str):
        mc = SimpleNamespace(name=mc, kwargs={})
    model = _build(mc, num_classes, data_channels)
    if probe is not None and probe.hw and data_channels:
        check_model(model, num_classes, data_channels, probe.hw, f"model.name {mc.name}",
                    probe.task, probe.width)
    return model


def _build(mc, num_classes: int | None, data_channels: int | None) -> nn.Module:
    """The model, its kwargs checked against its builder first (seams/kwargs.py)."""
    k = kind(mc.name)
    kwargs.check_kwargs(mc.kwargs, k, mc.name, BUILTIN[mc.name] if k == "builtin" else None)
    try:
        return _call_builder(mc, k, num_classes, data_channels)
    except UserError as e:  # a class behind the builder's **kwargs did not take one
        named = kwargs.unexpected_keyword(e, mc.kwargs, mc.name)
        if named is None and mc.kwargs and k in ("builtin", "torchvision"):
            # a built-in builds with any right values: a value of model.kwargs is wrong
            why = str(e).partition(" failed (")[2].rstrip(")") or str(e)
            named = UserError(f"model.kwargs {short(mc.kwargs, 80)}: {mc.name} could not be "
                              f"built with them ({why}); check each value's type and range "
                              f"against {mc.name}'s arguments")
        raise named or e from None


def _call_builder(mc, k: str, num_classes: int | None, data_channels: int | None):
    if k == "builtin":
        return call(BUILTIN[mc.name], "model.name", args=(num_classes,),
                    kwargs={"in_channels": data_channels or 3, **mc.kwargs})
    if k == "user":
        add_code_dir(getattr(mc, "code_dir", None), "model.code_dir")
        fn = load_callable(mc.name, "model.name")
        kwargs.check_kwargs(mc.kwargs, k, mc.name, fn)  # the same contract as a built-in's
        model = call(fn, "model.name", kwargs=mc.kwargs,
                     optional={"num_classes": num_classes, "in_channels": data_channels})
        if not isinstance(model, nn.Module):
            raise UserError(f"model.name: {mc.name} returned {type(model).__name__}, not a "
                            f"torch.nn.Module")
        return model
    if k == "timm":
        try:
            import timm
        except ImportError:
            raise UserError(f"model.name {mc.name} needs timm, which is not installed: "
                            f"pip install 'ddpflow[timm]'") from None
        return call(timm.create_model, "model.name", args=(mc.name[5:],),
                    kwargs={"pretrained": False, "num_classes": num_classes,
                            "in_chans": data_channels or 3, **mc.kwargs})
    import torchvision  # imported only here: a CPU-only image may lack a matching torchvision

    available = torchvision.models.list_models(module=torchvision.models)
    if mc.name not in available:
        close = [m for m in available if m.startswith(mc.name[:4])][:8]
        raise UserError(f"model.name '{mc.name}' is not one of {sorted(BUILTIN)}, a torchvision "
                        f"classification model, timm:NAME nor package.module:callable"
                        + (f"; close: {', '.join(close)}" if close else ""))
    return call(torchvision.models.get_model, "model.name", args=(mc.name,),
                kwargs={"weights": None, "num_classes": num_classes, **mc.kwargs})


def forward(model: nn.Module, inputs):
    """model(x); a tuple of inputs is spread as positional arguments, a dict as keywords."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_text(n: int) -> str:
    """A count as people say it: 812, 3.8 k, 11.2 M, 1.3 G (a 3.8 k model is not "0.00 M")."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        text = f"{n / size:.3g}"
        if float(text) >= 1:  # as rounded: 999,999 is "1 M", not "1e+03 k"
            return f"{text} {unit}"
    return str(n)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP / DataParallel / torch.compile wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


