"""``mooncake.engine`` on pymooncake: ``pymooncake.transfer.compat.TransferEngine``."""

from pymooncake.transfer.compat import TransferEngine, TransferOpcode
from pymooncake.transfer.compat_util import TransferNotify

# what this build supports, as Mooncake's module flags say (tcp/shm on CPU only)
SUPPORT_CUDA = SUPPORT_HIP = SUPPORT_MUSA = SUPPORT_EFA = SUPPORT_INTRA_NVLINK = False
Read, Write = TransferOpcode.Read, TransferOpcode.Write

__all__ = ["TransferEngine", "TransferNotify", "TransferOpcode", "Read", "Write",
           "SUPPORT_CUDA", "SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_INTRA_NVLINK",
           "SUPPORT_MUSA"]
