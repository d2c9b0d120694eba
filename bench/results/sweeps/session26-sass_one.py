"""SASS of the forward at D=32 for sm_90 (the launch rule's config), to stdout; the PTX to /tmp/fwd.ptx.
Run from the repository root (bench/NOTES.md entry 60):
    python bench/results/sweeps/session26-sass_one.py float32 3 2   # a decoder (S=3, Q=2); S == Q: an encoder"""
import subprocess, sys, tempfile, os, re
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
import torch, triton
import compile_check as cc
from msda.kernels import launch
from msda.kernels.forward import msda_forward_kernel
CUOBJ = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
cap = {}
orig = triton.compile
def grab(*a, **k):
    cap["c"] = orig(*a, **k); return cap["c"]
cc.triton.compile = grab
launch.register_target = lambda device: True
dtype = sys.argv[1]; S, Q = int(sys.argv[2]), int(sys.argv[3])
value_dtype, loc_dtype, acc = cc.DTYPES[dtype]
B, M, L, K, D = 1, 8, 4, 4, 32
value = torch.zeros(B, S, M, D, dtype=value_dtype)
shapes = torch.ones(L, 2, dtype=torch.int64); starts = torch.zeros(L, dtype=torch.int64)
loc = torch.zeros(B, Q, M, L, K, 2, dtype=loc_dtype); attn = torch.zeros(B, Q, M, L, K, dtype=loc_dtype)
out = torch.zeros(B, Q, M * D, dtype=value_dtype)
_, args, cx = launch.forward_call(value, shapes, starts, loc, attn, out)
print({k: v for k, v in cx.items()}, file=sys.stderr)
cc.compile_for_hopper(msda_forward_kernel, args, cx)
f = tempfile.NamedTemporaryFile(suffix=".cubin", delete=False); f.write(cap["c"].asm["cubin"]); f.close()
print(subprocess.run([CUOBJ, "-sass", f.name], capture_output=True, text=True).stdout)
open("/tmp/fwd.ptx", "w").write(cap["c"].asm["ptx"])
