"""Transports over ``torch.distributed``: node mode under torchrun, and broadcasting a batch."""
