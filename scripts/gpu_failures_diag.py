"""Diagnose the two CUDA test failures of 2026-12-05 (benchmarks/RESULTS.md, eleventh session).

1. split_kv_attention vs SDPA: per-block log-sum-exp and output of PyTorch's memory-efficient
   kernel against float64, for a row with fully masked blocks (batch 0) and one without.
2. int4-streamed logits vs the model round-tripped through int4 on the CPU and on the GPU.
Run on a CUDA machine: `bash scripts/device_plan.sh diag`.
"""
import os, torch, json
from shardwise.inference.layers import split_kv_attention, efficient_chunks
torch.backends.cuda.matmul.allow_tf32 = False
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(2, 4, 2, 64, device="cuda", generator=g)
k = torch.randn(2, 4, 256, 64, device="cuda", generator=g)
v = torch.randn(2, 4, 256, 64, device="cuda", generator=g)
mask = torch.zeros(2, 1, 2, 256, dtype=torch.bool, device="cuda")
mask[0, ..., :70] = True
mask[1, ..., 5:200] = True
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
s = (q.double() @ k.double().transpose(-1, -2)) * 0.125
s = s.masked_fill(~mask, float("-inf"))
ref64 = (s.softmax(-1) @ v.double())
print("sdpa vs f64", (ref.double() - ref64).abs().amax(dim=(1, 2, 3)).tolist())
out = split_kv_attention(q, k, v, mask, 0.125)
print("split vs f64 per batch", (out.double() - ref64).abs().amax(dim=(1, 2, 3)).tolist())
b, h, G, d = q.shape; n = 4; chunk = 64
kc, vc = k.reshape(b, h * n, chunk, d), v.reshape(b, h * n, chunk, d)
qc = q.unsqueeze(2).expand(b, h, n, G, d).reshape(b, h * n, G, d)
bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
bias = bias.view(b, 1, G, n, chunk).transpose(2, 3).expand(b, h, n, G, chunk).reshape(b, h * n, G, chunk).contiguous()
o, lse = efficient_chunks(qc, kc, vc, bias, 0.125)
o = o.reshape(b, h, n, G, d); lse = lse.reshape(b, h, n, G)
sc = (qc.double() @ kc.double().transpose(-1, -2)) * 0.125 + bias.double()
lse64 = torch.logsumexp(sc, -1).reshape(b, h, n, G)
o64 = (sc.softmax(-1) @ vc.double()).reshape(b, h, n, G, d)
print("lse kernel b0 h0", lse[0, 0].tolist())
print("lse f64    b0 h0", lse64[0, 0].tolist())
print("lse kernel b1 h0", lse[1, 0].tolist())
print("lse f64    b1 h0", lse64[1, 0].tolist())
print("out err per block b0", (o.double() - o64).nan_to_num(0).abs().amax(dim=(1, 3, 4))[0].tolist())
print("out nan per block b0", o.isnan().any(-1).any(1)[0].tolist(), "out absmax", o.abs().amax(dim=(1, 3, 4))[0].tolist())
print("out err per block b1", (o.double() - o64).abs().amax(dim=(1, 3, 4))[1].tolist())
# the lse of the kernel padded: check the raw shape
raw = torch.ops.aten._scaled_dot_product_efficient_attention(qc, kc, vc, bias, True, scale=0.125)
print("raw lse shape", tuple(raw[1].shape), "out shape/strides", tuple(raw[0].shape), raw[0].stride())
print("raw lse row b0 chunk1", raw[1][0, 1, :4].tolist())
print("---- int4 streaming")
import copy, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import shardwise
from tests.gpu.test_zero_inference_gpu import _cuda
from tests.unit.test_zero_inference import model
from shardwise.inference.quant_stream import QuantSpec, roundtrip
m = model("llama", layers=5, hidden=128, ffn=512)
ids, _ = _cuda(2)
wq = {"quantized_initialization": {"num_bits": 4, "group_size": 64}}
eng = shardwise.init_inference(copy.deepcopy(m), dtype="fp32", weight_quantization=wq,
                               zero={"stage": 3, "offload_param": {"device": "cpu"},
                                     "stage3_param_persistence_threshold": 1000})
got = eng(ids).logits
for where in ("cpu", "cuda"):
    r = copy.deepcopy(m)
    for layer in r.model.layers:
        for p in layer.parameters():
            if p.numel() > 1000:
                p.data = roundtrip(p.data.to(where), QuantSpec(4, 64)).cpu()
    ref = r.cuda()(ids).logits
    print(where, "round trip: max abs", (got - ref).abs().max().item(), "ref absmax", ref.abs().max().item())
print("unquantized vs int4: max abs", (got - copy.deepcopy(m).cuda()(ids).logits).abs().max().item())
