"""hcomm: point-to-point communication for accelerators, from Python.

``import hcomm.torch`` registers the torch.distributed backend ``"hcomm"`` and
provides one-sided tensor windows (``hcomm.torch.Window``).
"""

__all__ = ["torch"]
