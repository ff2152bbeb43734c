"""Tests for the deterministic model zoo in ``mcgraph.models``."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import mcgraph.models as models
from mcgraph.models import MODELS, get_model, register_model

SEQUENCE_NAMES = ("lstm", "transformer")  # read images row by row: tested on their own below
ALL_NAMES = sorted(set(MODELS) - set(SEQUENCE_NAMES))

# Exact parameter counts at the default arguments (10 classes, except
# unet3d_encoder: 2 classes, 1 channel). Published references: ResNet, VGG-BN,
# DenseNet-121/169/161 and PreAct-ResNet-18 (without the final BN-ReLU, +1,024
# here) match kuangliu/pytorch-cifar; LeNet-5 and AlexNet by hand, e.g.
# LeNet-5 = 156 + 2,416 + 48,120 + 10,164 + 850.
EXPECTED_PARAMS = {
    "lenet5": 61_706,
    "lenet5_caffe": 431_080,
    "lenet300_100": 266_610,
    "alexnet": 2_472_266,
    "vgg11": 9_231_114,
    "vgg13": 9_416_010,
    "vgg16": 14_728_266,
    "vgg19": 20_040_522,
    "resnet18": 11_173_962,
    "resnet34": 21_282_122,
    "resnet50": 23_520_842,
    "resnet101": 42_512_970,
    "resnet152": 58_156_618,
    "preact_resnet18": 11_172_170,
    "preact_resnet34": 21_280_330,
    "preact_resnet50": 23_513_162,
    "densenet121": 6_956_298,
    "densenet161": 26_482_378,
    "densenet169": 12_493_322,
    "densenet201": 18_104_330,
    "unet3d_encoder": 220_282,
}

# Rounded counts quoted for the standard CIFAR variants, checked to 1%.
PUBLISHED_PARAMS = {
    "resnet18": 11.17e6,
    "resnet34": 21.28e6,
    "resnet50": 23.52e6,
    "resnet101": 42.51e6,
    "resnet152": 58.16e6,
    "vgg16": 14.7e6,
    "densenet121": 6.96e6,
    "preact_resnet18": 11.17e6,
}

INPUT_SHAPES = {"lenet5": (1, 28, 28), "lenet5_caffe": (1, 28, 28), "lenet300_100": (1, 28, 28), "unet3d_encoder": (1, 32, 32, 32)}
DEFAULT_INPUT = (3, 32, 32)

# Cheap models used for the gradient, wrapping and resizing checks.
SMALL_NAMES = [
    "lenet5",
    "alexnet",
    "vgg11",
    "resnet18",
    "resnet50",
    "preact_resnet18",
    "preact_resnet50",
    "densenet121",
    "unet3d_encoder",
]

WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@functools.lru_cache(maxsize=None)
def _default_model(name: str) -> nn.Module:
    """A default-argument model in eval mode, shared by read-only tests."""
    torch.manual_seed(0)
    return MODELS[name]().eval()


def _input(name: str, batch: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(batch, *INPUT_SHAPES.get(name, DEFAULT_INPUT), generator=generator)


def test_registry_holds_every_requested_model():
    expected = set(EXPECTED_PARAMS)
    assert set(MODELS) == expected | set(SEQUENCE_NAMES)
    assert expected <= set(models.__all__)
    for name in expected:
        assert getattr(models, name) is MODELS[name]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_parameter_count_pinned(name):
    assert _num_params(_default_model(name)) == EXPECTED_PARAMS[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_count_matches_published(name):
    count = _num_params(_default_model(name))
    assert count == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01)


def test_resnet18_is_the_standard_cifar_resnet18():
    assert _num_params(models.resnet18(num_classes=10)) == 11_173_962


@pytest.mark.parametrize("name", ALL_NAMES)
def test_forward_shape_at_default_input(name):
    model = _default_model(name)
    with torch.no_grad():
        out = model(_input(name))
    num_classes = 2 if name == "unet3d_encoder" else 10
    assert out.shape == (2, num_classes)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["alexnet", "vgg11", "resnet18", "preact_resnet18", "densenet121"])
@pytest.mark.parametrize("size", [40, 64])
def test_cifar_models_accept_larger_inputs(name, size):
    with torch.no_grad():
        out = _default_model(name)(torch.randn(2, 3, size, size))
    assert out.shape == (2, 10)


def test_lenet5_accepts_cifar_size_and_unet_other_volumes():
    with torch.no_grad():
        assert _default_model("lenet5")(torch.randn(2, 1, 32, 32)).shape == (2, 10)
        assert _default_model("unet3d_encoder")(torch.randn(2, 1, 16, 24, 8)).shape == (2, 2)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_num_classes_and_in_channels_are_honoured(name):
    model = get_model(name, num_classes=7, in_channels=2)
    if not any(isinstance(m, WEIGHTED[1:]) for m in model.modules()):  # an MLP: the first Linear is the stem
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        first, head = linears[0], linears[-1]
        default = [m for m in MODELS[name]().modules() if isinstance(m, nn.Linear)]
        assert first.in_features == 2 * default[0].in_features and head.out_features == 7
        expected_delta = first.out_features * default[0].in_features + (head.in_features + 1) * (7 - 10)
        assert _num_params(model) - EXPECTED_PARAMS[name] == expected_delta
        return
    stem = next(m for m in model.modules() if isinstance(m, WEIGHTED[1:]))
    head = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    assert stem.in_channels == 2
    assert head.out_features == 7
    # Only the stem conv and the linear head change size with these arguments.
    default = MODELS[name]()
    default_stem = next(m for m in default.modules() if isinstance(m, WEIGHTED[1:]))
    default_head = [m for m in default.modules() if isinstance(m, nn.Linear)][-1]
    per_channel = stem.weight.numel() // stem.in_channels
    per_class = head.in_features + 1
    expected_delta = (
        per_channel * (2 - default_stem.in_channels)
        + per_class * (7 - default_head.out_features)
    )
    assert _num_params(model) - EXPECTED_PARAMS[name] == expected_delta


def test_unet3d_encoder_width_and_depth():
    model = models.unet3d_encoder(base_channels=4, depth=3, num_classes=5)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv3d)]
    assert [c.out_channels for c in convs] == [4, 4, 8, 8, 16, 16]
    assert sum(isinstance(m, nn.MaxPool3d) for m in model.modules()) == 2
    assert model.classifier[-1].in_features == 16
    assert model(torch.randn(2, 1, 8, 8, 8)).shape == (2, 5)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_parameters_live_only_in_swappable_modules(name):
    # bayesify replaces Linear/Conv modules; no other module may own weights.
    for module_name, module in _default_model(name).named_modules():
        if next(module.parameters(recurse=False), None) is not None:
            assert isinstance(module, WEIGHTED + NORMS), module_name


class _Wrapped(nn.Module):
    """Stands in for a Bayesian layer: owns the original module, counts calls."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)


def _wrap_weighted(model: nn.Module) -> list[_Wrapped]:
    wrapped = []
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, WEIGHTED):
                wrapper = _Wrapped(child)
                setattr(parent, child_name, wrapper)
                wrapped.append(wrapper)
    return wrapped


@pytest.mark.parametrize("name", ALL_NAMES)
def test_replacing_weighted_modules_keeps_the_function(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    x = _input(name)
    with torch.no_grad():
        reference = model(x)
        wrappers = _wrap_weighted(model)
        replaced = model(x)
    assert len(wrappers) == sum(isinstance(m, WEIGHTED) for m in MODELS[name]().modules())
    assert all(w.calls == 1 for w in wrappers)
    torch.testing.assert_close(replaced, reference)


@pytest.mark.parametrize("name", SMALL_NAMES)
def test_every_parameter_gets_a_gradient_in_train_mode(name):
    torch.manual_seed(0)
    model = MODELS[name]().train()
    model(_input(name)).square().sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert missing == []


def test_get_model_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="name") as info:
        get_model("resnet9000")
    message = str(info.value)
    assert "resnet9000" in message
    for name in ALL_NAMES:
        assert name in message


def test_get_model_forwards_kwargs_and_rejects_unknown_ones():
    assert get_model("lenet5", num_classes=3)(torch.randn(2, 1, 28, 28)).shape == (2, 3)
    with pytest.raises(TypeError):
        get_model("lenet5", depth=3)


def test_register_model_rejects_duplicates_and_registers_new_builders():
    with pytest.raises(ValueError, match="resnet18"):
        register_model("resnet18")(models.resnet18)

    @register_model("_test_linear")
    def _test_linear(num_classes=10, in_channels=4):
        return nn.Linear(in_channels, num_classes)

    try:
        assert get_model("_test_linear", num_classes=3).out_features == 3
    finally:
        del MODELS["_test_linear"]


@pytest.mark.parametrize(
    ("builder", "kwargs", "argument"),
    [
        (models.resnet18, {"num_classes": 0}, "num_classes"),
        (models.vgg16, {"in_channels": -1}, "in_channels"),
        (models.lenet5, {"num_classes": 2.5}, "num_classes"),
        (models.densenet121, {"in_channels": True}, "in_channels"),
        (models.alexnet, {"num_classes": "10"}, "num_classes"),
        (models.unet3d_encoder, {"depth": 0}, "depth"),
        (models.unet3d_encoder, {"base_channels": -8}, "base_channels"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_them(builder, kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        builder(**kwargs)


def test_class_level_validation():
    with pytest.raises(ValueError, match="num_blocks"):
        models.ResNet(models.BasicBlock, (2, 2, 2))
    with pytest.raises(ValueError, match="block_config"):
        models.DenseNet((6, 12, 24))
    with pytest.raises(ValueError, match="reduction"):
        models.DenseNet((1, 1, 1, 1), reduction=1.5)
    with pytest.raises(ValueError, match="config"):
        models.VGG((64, "X"))
    with pytest.raises(ValueError, match="config"):
        models.VGG(("M",))
    with pytest.raises(ValueError, match="spatial_dims"):
        models.UNetEncoder(spatial_dims=4)


def test_unet_encoder_is_dimension_generic():
    model = models.UNetEncoder(spatial_dims=2, in_channels=3, num_classes=4, depth=2)
    assert all(not isinstance(m, nn.Conv3d) for m in model.modules())
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 4)


@pytest.mark.parametrize("name", SEQUENCE_NAMES)
def test_sequence_models_read_images_by_rows_and_bayesify(name):
    import mcgraph.nn as mnn

    torch.manual_seed(0)
    net = get_model(name, num_classes=10)
    x = torch.randn(3, 1, 28, 28)
    assert net(x).shape == (3, 10)
    assert get_model(name, num_classes=10, input_size=8)(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    with pytest.raises(ValueError, match="in_channels must be 1"):
        get_model(name, in_channels=3)
    bnn = mnn.bayesify(net, kl_samples=4)
    assert mnn.bayesian_modules(bnn) and float(mnn.kl(bnn, seed=0)) > 0
    assert mnn.predict(bnn, x, 4, seed=0).shape == (3, 10)
