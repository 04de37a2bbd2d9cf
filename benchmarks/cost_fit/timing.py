"""Forward plus backward of one packed row, timed (CUDA events on a GPU)."""

from __future__ import annotations

import time

import torch

from benchmarks.cost_fit.attention import Flex, row_ctx
from benchmarks.cost_fit.model import RowCtx, Shape, Stack


class Timer:
    def __init__(
        self,
        stack: Stack,
        s: Shape,
        device: torch.device,
        dtype: torch.dtype,
        flex: Flex | None,
        max_tokens: int,
    ):
        self.stack, self.s, self.device, self.dtype, self.flex = stack, s, device, dtype, flex
        g = torch.Generator(device="cpu").manual_seed(0)
        # random activations, [1, max_tokens, hidden]; a row of T tokens takes the first T
        self.base = torch.randn(1, max_tokens, s.hidden, generator=g).to(device, dtype)
        self.cuda = device.type == "cuda"

    def _step(self, x: torch.Tensor, ctx: RowCtx) -> None:
        self.stack(x, ctx).float().square().mean().backward()

    def _clear(self, x: torch.Tensor) -> None:
        x.grad = None
        self.stack.zero_grad(set_to_none=True)

    def measure(self, lengths: list[int], warmup: int, reps: int) -> list[float]:
        """Milliseconds of forward + backward, ``reps`` times, after ``warmup`` untimed runs."""
        x = self.base[:, : sum(lengths)].detach().requires_grad_(True)
        ctx = row_ctx(lengths, self.device, self.flex)  # the block mask too: not timed
        for _ in range(warmup):
            self._clear(x)
            self._step(x, ctx)
        times = []
        for _ in range(reps):
            self._clear(x)
            if self.cuda:
                torch.cuda.synchronize()
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                self._step(x, ctx)
                end.record()
                end.synchronize()
                times.append(float(start.elapsed_time(end)))
            else:
                t0 = time.perf_counter()
                self._step(x, ctx)
                times.append(1e3 * (time.perf_counter() - t0))
        self._clear(x)
        return times
