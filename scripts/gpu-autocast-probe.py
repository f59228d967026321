#!/usr/bin/env python3
"""Where float16 overflows in the loss's gradient (docs/gpu.md, third session): cross_entropy under autocast
on float16 logits against cross_entropy on the logits converted to float32, at loss scales 2^18 and
2^19 with a batch of 8. Prints the dtype and largest |gradient| reaching the float16 logits. Needs CUDA."""
import torch, torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(8, 4, device="cuda")
y = torch.arange(8, device="cuda") % 4
for where in ("inside", "outside"):
    for S in (2.0**18, 2.0**19):
        w = torch.randn(4, 4, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = x @ w
            ls = torch.log_softmax(out, 1)
            loss = F.cross_entropy(out, y) if where == "inside" else None
        if where == "outside":
            loss = F.cross_entropy(out.float(), y)
        g = {}
        out.register_hook(lambda t: g.__setitem__("out", (t.dtype, t.abs().max().item())))
        (loss * S).backward()
        print(where, "S=%g" % S, "out", out.dtype, "log_softmax", ls.dtype, "loss", loss.dtype,
              "grad(out)", g.get("out"), "grad(w) finite", bool(torch.isfinite(w.grad).all()))
