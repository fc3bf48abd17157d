"""A U-Net: an encoder of DoubleConvs and max-pools, a bottleneck, and a decoder of ``Up`` stages.

The skip connections make it a model that is *not* a simple chain: every encoder output is held
until the matching decoder stage runs, so it is a good test of how remat treats long-lived tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import RematError
from remat.models import Workload, _check_positive, _place, _seeded

__all__ = ["UNet", "DoubleConv", "Up", "unet", "unet_workload"]


class DoubleConv(nn.Module):
    """Two 3x3 conv-BN-ReLU layers that keep height and width.

    Args:
        in_channels: Channels of the input.
        out_channels: Channels of both convolutions and of the output.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs the two layers.

        Args:
            x: Input of shape ``[B, in_channels, H, W]``.

        Returns:
            Output of shape ``[B, out_channels, H, W]``.
        """
        x = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(x)))


class Up(nn.Module):
    """One decoder stage: upsample by 2 (transposed conv), concatenate the skip, DoubleConv.

    Args:
        in_channels: Channels of the input from the stage below.
        out_channels: Channels of the skip connection and of the output.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, out_channels, kernel_size=2, stride=2)
        self.conv = DoubleConv(2 * out_channels, out_channels)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        """Runs the stage.

        Args:
            x: Input of shape ``[B, in_channels, H, W]``.
            skip: The matching encoder output, ``[B, out_channels, H', W']`` with ``H' >= 2H`` and
                ``W' >= 2W`` (larger by one where the encoder pooled an odd size).

        Returns:
            Output of shape ``[B, out_channels, H', W']``.
        """
        x = self.up(x)
        dh, dw = skip.size(-2) - x.size(-2), skip.size(-1) - x.size(-1)
        if dh or dw:
            x = F.pad(x, [dw // 2, dw - dw // 2, dh // 2, dh - dh // 2])
        return self.conv(torch.cat([skip, x], dim=1))


class UNet(nn.Module):
    """A U-Net for dense prediction (build it with :func:`unet`).

    Args:
        features: Channels of each encoder stage, top to bottom; the bottleneck has twice the last.
        in_channels: Channels of the input images.
        out_channels: Channels of the output map.
    """

    def __init__(self, features: Sequence[int], in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.downs = nn.ModuleList()
        channels = in_channels
        for f in features:
            self.downs.append(DoubleConv(channels, f))
            channels = f
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
        self.bottleneck = DoubleConv(features[-1], 2 * features[-1])
        self.ups = nn.ModuleList(Up(2 * f, f) for f in reversed(features))
        self.final = nn.Conv2d(features[0], out_channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps a batch of images to a per-pixel output.

        Args:
            x: Images of shape ``[B, in_channels, H, W]`` with ``H, W >= 2**len(features)``.

        Returns:
            Output of shape ``[B, out_channels, H, W]``.
        """
        skips = []
        for down in self.downs:
            x = down(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, skip in zip(self.ups, reversed(skips), strict=True):
            x = up(x, skip)
        return self.final(x)


def _check_features(features: Sequence[int]) -> None:
    if not isinstance(features, Sequence) or len(features) == 0:
        raise RematError(
            f"unet: features must be a non-empty sequence of channel counts, got {features!r}; "
            "pass e.g. features=(16, 32, 64)."
        )
    _check_positive("unet", **{f"features[{i}]": f for i, f in enumerate(features)})


def unet(*, features: Sequence[int] = (16, 32, 64), in_channels: int = 3, out_channels: int = 1) -> UNet:
    """Builds a U-Net with freshly initialised weights (from the current CPU generator), on the CPU.

    Args:
        features: Channels of each encoder stage, top to bottom (one stage per entry).
        in_channels: Channels of the input images.
        out_channels: Channels of the output map.

    Returns:
        The model, in training mode.

    Raises:
        RematError: If ``features`` is not a non-empty sequence of positive ints, or a channel
            count is not a positive int.
    """
    _check_features(features)
    _check_positive("unet", in_channels=in_channels, out_channels=out_channels)
    return UNet(tuple(features), in_channels, out_channels)


def unet_workload(
    *,
    features: Sequence[int] = (16, 32, 64),
    image_size: int = 64,
    batch: int = 4,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Workload:
    """A U-Net on a batch of random RGB images, with an MSE loss against a random 1-channel map.

    Args:
        features: Channels of each encoder stage, top to bottom.
        image_size: Height and width of the images (pixels); at least ``2**len(features)``.
        batch: Number of images in the batch.
        seed: Seed of the weights, the batch and the target (see NOTE [ Model seeding ]).
        device: Device of the model and the batch.
        dtype: Floating-point dtype of the parameters, the images and the target.

    Returns:
        The workload; ``inputs`` has shape ``[batch, 3, image_size, image_size]`` and the model's
        output ``[batch, 1, image_size, image_size]``.

    Raises:
        RematError: If a size is invalid (see :func:`unet`), the images are too small for the
            number of stages, or ``dtype`` is not floating point.
    """
    _check_positive("unet", image_size=image_size, batch=batch)
    _check_features(features)
    smallest = 2 ** len(features)
    if image_size < smallest:
        raise RematError(
            f"unet: image_size {image_size} is below {smallest}, the smallest that {len(features)} "
            "pooling stages can halve; raise image_size or pass fewer features."
        )
    with _seeded(seed):
        model = unet(features=features)
        images = torch.randn(batch, 3, image_size, image_size)
        target = torch.randn(batch, 1, image_size, image_size)
    _place(model, "unet", device, dtype)
    images, target = images.to(device=device, dtype=dtype), target.to(device=device, dtype=dtype)

    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    return Workload(
        name="unet",
        model=model,
        inputs=images,
        loss_fn=loss_fn,
        description=f"UNet features={tuple(features)}, batch {batch}x3x{image_size}x{image_size}",
    )
