"""chorus for PyTorch's Python users: `import chorus` registers the torch.distributed backend
"chorus" (docs/python.md).

    import chorus, torch.distributed as dist
    dist.init_process_group("chorus")   # was "gloo"

The backend runs chorus's shared-memory and TCP collectives (chorus's C++ library, in chorus._C).
"""
import json as _json
import os as _os
import sys as _sys
import time as _time

import torch as _torch
import torch.distributed as _dist

from chorus import _C

__all__ = ["BACKEND"]

BACKEND = "chorus"


def _create(store, rank, world_size, timeout):
    return _C.create_process_group(store, rank, world_size, timeout)


if not hasattr(_dist.Backend, BACKEND.upper()):
    if int(_torch.__version__.split(".")[0]) >= 2:
        # 2.x: a backend per device type (the C++ side is a c10d::Backend there; never built here)
        _dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    else:
        _dist.Backend.register_backend(BACKEND, _create)


def _record_uncaught(exc_type, exc, tb):
    """Under `chorus run` (CHORUS_ERROR_FILE set), an uncaught exception's last traceback line is
    recorded as this rank's error, so the launcher's report names it as the root cause (the same
    record a C++ rank writes: {"message", "type", "relayed", "rank", "pid", "time"})."""
    path = _os.environ.get("CHORUS_ERROR_FILE")
    if path and not issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
        try:
            message = "%s: %s" % (exc_type.__name__, exc) if str(exc) else exc_type.__name__
            # chorus's errors that another rank caused (a dead or failed peer) say so.
            relayed = "failed because" in str(exc) or "aborted by rank" in str(exc)
            record = {"message": message, "type": exc_type.__name__, "relayed": relayed,
                      "rank": int(_os.environ.get("RANK", "-1")), "pid": _os.getpid(), "time": _time.time()}
            tmp = "%s.%d.tmp" % (path, _os.getpid())
            with open(tmp, "w") as f:
                _json.dump(record, f)
            _os.replace(tmp, path)
        except OSError:
            pass
    _previous_hook(exc_type, exc, tb)


_previous_hook = _sys.excepthook
_sys.excepthook = _record_uncaught
