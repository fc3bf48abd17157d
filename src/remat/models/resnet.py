"""A ResNet for small images (CIFAR-style stem, no max-pool), with basic or bottleneck blocks.

ReLUs are out-of-place: an in-place ReLU would overwrite the output of a block that remat may have
checkpointed, and its memory would then differ from what a profile of the plain model measured.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import RematError
from remat.models import Workload, _check_positive, _place, _seeded

__all__ = ["ResNet", "BasicBlock", "Bottleneck", "resnet", "resnet_workload"]


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module | None:
    """A 1x1 conv + BatchNorm projection where the residual's shape changes, else None."""
    if stride == 1 and in_channels == out_channels:
        return None
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
        nn.BatchNorm2d(out_channels),
    )


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual connection.

    Args:
        in_channels: Channels of the input.
        planes: Channels of both convolutions and of the output.
        stride: Stride of the first convolution (2 halves height and width).
    """

    expansion = 1

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = _shortcut(in_channels, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs the block.

        Args:
            x: Input of shape ``[B, in_channels, H, W]``.

        Returns:
            Output of shape ``[B, planes, H / stride, W / stride]``.
        """
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4) conv-BN layers with a residual connection.

    Args:
        in_channels: Channels of the input.
        planes: Channels of the inner convolutions; the output has ``4 * planes``.
        stride: Stride of the 3x3 convolution (2 halves height and width).
    """

    expansion = 4

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU()
        self.downsample = _shortcut(in_channels, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs the block.

        Args:
            x: Input of shape ``[B, in_channels, H, W]``.

        Returns:
            Output of shape ``[B, 4 * planes, H / stride, W / stride]``.
        """
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


_BLOCKS: dict[str, type[BasicBlock] | type[Bottleneck]] = {"basic": BasicBlock, "bottleneck": Bottleneck}


class ResNet(nn.Module):
    """A ResNet: ``stem``, stages ``layer1..layerN``, ``avgpool``, ``fc`` (build it with :func:`resnet`).

    Stage ``i`` (from 0) has ``width * 2**i`` planes; every stage after the first starts with a
    stride-2 block. Stages are attributes ``layer1``, ``layer2``, ... (one per entry of ``layers``).

    Args:
        block: The block class, :class:`BasicBlock` or :class:`Bottleneck`.
        layers: Number of blocks in each stage.
        width: Planes of the first stage (channels).
        num_classes: Number of output classes.
        in_channels: Channels of the input images.
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: Sequence[int],
        width: int,
        num_classes: int,
        in_channels: int,
    ) -> None:
        super().__init__()
        self.num_stages = len(layers)
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        channels = width
        for i, n_blocks in enumerate(layers):
            planes = width * 2**i
            stage: list[nn.Module] = []
            for j in range(n_blocks):
                stride = 2 if i > 0 and j == 0 else 1
                stage.append(block(channels, planes, stride))
                channels = planes * block.expansion
            self.add_module(f"layer{i + 1}", nn.Sequential(*stage))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Classifies a batch of images.

        Args:
            x: Images of shape ``[B, in_channels, H, W]``.

        Returns:
            Logits of shape ``[B, num_classes]``.
        """
        x = self.stem(x)
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet(
    *,
    block: str = "basic",
    layers: Sequence[int] = (2, 2, 2, 2),
    width: int = 16,
    num_classes: int = 10,
    in_channels: int = 3,
) -> ResNet:
    """Builds a ResNet with freshly initialised weights (from the current CPU generator), on the CPU.

    Args:
        block: ``"basic"`` (two 3x3 convs) or ``"bottleneck"`` (1x1, 3x3, 1x1 with 4x expansion).
        layers: Number of blocks in each stage; one stage per entry.
        width: Planes of the first stage (channels); doubles at each stage.
        num_classes: Number of output classes.
        in_channels: Channels of the input images.

    Returns:
        The model, in training mode.

    Raises:
        RematError: If ``block`` is unknown, ``layers`` is not a non-empty sequence, or a size is not
            a positive int.
    """
    block_cls = _BLOCKS.get(block)
    if block_cls is None:
        raise RematError(
            f"resnet: unknown block {block!r}; valid blocks are {', '.join(sorted(_BLOCKS))}. "
            "Pass one of them as block=."
        )
    if not isinstance(layers, Sequence) or len(layers) == 0:
        raise RematError(
            f"resnet: layers must be a non-empty sequence of block counts, got {layers!r}; "
            "pass one count per stage, e.g. layers=(2, 2, 2, 2)."
        )
    _check_positive("resnet", width=width, num_classes=num_classes, in_channels=in_channels)
    _check_positive("resnet", **{f"layers[{i}]": n for i, n in enumerate(layers)})
    return ResNet(block_cls, tuple(layers), width, num_classes, in_channels)


def resnet_workload(
    *,
    block: str = "basic",
    layers: Sequence[int] = (2, 2, 2, 2),
    width: int = 16,
    image_size: int = 64,
    batch: int = 8,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Workload:
    """A ResNet on a batch of random RGB images, with cross entropy against random labels (10 classes).

    Args:
        block: ``"basic"`` or ``"bottleneck"``.
        layers: Number of blocks in each stage.
        width: Planes of the first stage (channels).
        image_size: Height and width of the images (pixels).
        batch: Number of images in the batch.
        seed: Seed of the weights, the batch and the labels (see NOTE [ Model seeding ]).
        device: Device of the model and the batch.
        dtype: Floating-point dtype of the parameters and the images.

    Returns:
        The workload; ``inputs`` has shape ``[batch, 3, image_size, image_size]`` and the model's
        output is ``[batch, 10]`` logits.

    Raises:
        RematError: If a size is invalid (see :func:`resnet`) or ``dtype`` is not floating point.
    """
    num_classes = 10
    _check_positive("resnet", image_size=image_size, batch=batch)
    with _seeded(seed):
        model = resnet(block=block, layers=layers, width=width, num_classes=num_classes)
        images = torch.randn(batch, 3, image_size, image_size)
        labels = torch.randint(num_classes, (batch,))
    _place(model, "resnet", device, dtype)
    images, labels = images.to(device=device, dtype=dtype), labels.to(device)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels)

    return Workload(
        name="resnet",
        model=model,
        inputs=images,
        loss_fn=loss_fn,
        description=(
            f"ResNet-{block} layers={tuple(layers)} width={width}, "
            f"batch {batch}x3x{image_size}x{image_size}, {num_classes} classes"
        ),
    )
