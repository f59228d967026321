"""One rank of chorus.dask.run: `python -m chorus._dask_child PAYLOAD RESULT` unpickles
(fn, args, kwargs), sets up the default process group when CHORUS_DASK_BACKEND names a backend
(and destroys it after), calls fn, and writes {"value": ...} or {"error": "Type: message",
"traceback": ...} to RESULT. Exit status 0 on success, 1 when fn raised."""
import os
import sys
import traceback

import cloudpickle


def main():
    payload_path, result_path = sys.argv[1], sys.argv[2]
    with open(payload_path, "rb") as f:
        fn, args, kwargs = cloudpickle.load(f)
    backend = os.environ.get("CHORUS_DASK_BACKEND", "")
    try:
        if backend:  # run(..., backend=...): the default group is set up for fn, as dask-pytorch-ddp does
            import torch.distributed as dist
            if backend == "chorus":
                import chorus  # noqa: F401  (registers the backend)
            dist.init_process_group(backend)
        outcome = {"value": fn(*args, **kwargs)}
        if backend and dist.is_initialized():
            dist.destroy_process_group()
        code = 0
    except BaseException as e:  # noqa: B902  reported to the client, whatever it was
        outcome = {"error": "%s: %s" % (type(e).__name__, e) if str(e) else type(e).__name__,
                   "traceback": traceback.format_exc()}
        code = 1
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        cloudpickle.dump(outcome, f)
    os.replace(tmp, result_path)
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
