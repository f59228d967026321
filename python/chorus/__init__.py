"""chorus for PyTorch's Python users: `import chorus` registers the torch.distributed backend
"chorus" (docs/python.md).

    import chorus, torch.distributed as dist
    dist.init_process_group("chorus")   # was "gloo"

The backend runs chorus's shared-memory and TCP collectives (chorus's C++ library, in chorus._C).
"""
import torch.distributed as _dist

from chorus import _C

__all__ = ["BACKEND"]

BACKEND = "chorus"


def _create(store, rank, world_size, timeout):
    return _C.create_process_group(store, rank, world_size, timeout)


if not hasattr(_dist.Backend, BACKEND.upper()):
    _dist.Backend.register_backend(BACKEND, _create)
