"""Smoke check of a freshly built causal-conv1d on the GPU: packed (seq_idx) vs each conversation alone.

The 27B's gated-delta-net conv shape (10,240 channels, kernel 4), three conversations in one row, bf16,
forward and backward, against torch's depthwise conv1d run per conversation in fp32. Prints one RESULT
line. The thorough check is the GPU test suite (tests/gpu); this one only says the build runs and agrees.
"""
import json

import torch
import torch.nn.functional as F
from causal_conv1d import causal_conv1d_fn

torch.manual_seed(0)
D, W, lens = 10240, 4, [700, 37, 1311]
L = sum(lens)
x = torch.randn(1, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(D, W, device="cuda") / W).to(torch.bfloat16).requires_grad_()
seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lens)]).cuda()[None]
y = causal_conv1d_fn(x.transpose(1, 2), w, None, seq_idx=seq_idx, activation="silu").transpose(1, 2)
g = torch.randn_like(y)
(y.float() * g.float()).sum().backward()

xs, ws = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
outs, start = [], 0
for n in lens:
    seg = xs[:, start:start + n].transpose(1, 2)
    outs.append(F.silu(F.conv1d(F.pad(seg, (W - 1, 0)), ws[:, None], groups=D)).transpose(1, 2))
    start += n
ref = torch.cat(outs, 1)
(ref * g.float()).sum().backward()
err = lambda a, b: ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
print("RESULT " + json.dumps({"label": "causal_conv1d_smoke", "torch": torch.__version__,
      "gpu": torch.cuda.get_device_name(), "fwd_rel": err(y, ref), "dx_rel": err(x.grad, xs.grad),
      "dw_rel": err(w.grad, ws.grad)}))
