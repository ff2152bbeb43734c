"""Deterministic reference architectures (plain ``torch.nn``).

Every model is built only from ``nn.Linear``, ``nn.Conv{1,2,3}d``,
``nn.BatchNorm{1,2,3}d``, pooling and ``nn.ReLU`` modules, and every weighted
module is called through its own ``forward``; replacing each ``Linear``/``Conv``
by a Bayesian layer therefore yields a Bayesian network with no other edit.

Example:
    >>> import torch
    >>> from mcgraph.models import get_model
    >>> net = get_model("lenet5", num_classes=10)
    >>> net(torch.zeros(2, 1, 28, 28)).shape
    torch.Size([2, 10])
"""

from .alexnet import AlexNet, alexnet
from .densenet import DenseNet, densenet121, densenet161, densenet169, densenet201
from .lenet import LeNet5, lenet5
from .lenet_sparse import LeNet5Caffe, LeNet300100, lenet5_caffe, lenet300_100
from .zoo import MODELS, get_model, register_model
from .resnet import (
    BasicBlock,
    Bottleneck,
    PreActBasicBlock,
    PreActBottleneck,
    ResNet,
    preact_resnet18,
    preact_resnet34,
    preact_resnet50,
    resnet18,
    resnet34,
    resnet50,
    resnet101,
    resnet152,
)
from .unet import UNetEncoder, unet3d_encoder
from .sequence import LSTMClassifier, TransformerClassifier, lstm_classifier, transformer_classifier
from .vgg import VGG, VGG_CONFIGS, vgg11, vgg13, vgg16, vgg19

__all__ = [
    "MODELS",
    "get_model",
    "register_model",
    # classes
    "AlexNet",
    "BasicBlock",
    "Bottleneck",
    "DenseNet",
    "LeNet5",
    "LeNet5Caffe",
    "LeNet300100",
    "PreActBasicBlock",
    "PreActBottleneck",
    "ResNet",
    "UNetEncoder",
    "VGG",
    "LSTMClassifier",
    "TransformerClassifier",
    "VGG_CONFIGS",
    # builders
    "lenet5",
    "lenet5_caffe",
    "lenet300_100",
    "alexnet",
    "vgg11",
    "vgg13",
    "vgg16",
    "vgg19",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "preact_resnet18",
    "preact_resnet34",
    "preact_resnet50",
    "densenet121",
    "densenet161",
    "densenet169",
    "densenet201",
    "unet3d_encoder",
    "lstm_classifier",
    "transformer_classifier",
]
