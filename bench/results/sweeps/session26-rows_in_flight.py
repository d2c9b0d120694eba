"""Rows in flight: for each loop of a SASS listing (`python session26-sass_one.py float32 3 2 > f.sass`;
S=3, Q=2 is a decoder, Q == S an encoder), the most LDG.128 issued and not yet read. Usage:
python session26-rows_in_flight.py f.sass"""
import re, sys
lines = [re.sub(r" *\/\* 0x[0-9a-f]* \*\/", "", l).strip() for l in open(sys.argv[1]) if re.match(r"\s+/\*[0-9a-f]{4}\*/", l)]
instrs = [l.split("*/", 1)[1].strip().rstrip(" ;") for l in lines]
spill = sum("STL" in s or "LDL" in s for s in instrs)
res = []
for i, s in enumerate(instrs):
    m = re.search(r"BRA 0x([0-9a-f]+)", s)
    if m and int(m.group(1), 16) // 16 < i:
        body = instrs[int(m.group(1), 16) // 16:i + 1]
        out, peak, loads = [], 0, 0
        for t in body:
            ops = t.split(None, 1); args = ops[1] if len(ops) > 1 else ""
            src = set(re.findall(r"\bR(\d+)\b", args.split(",", 1)[1] if "," in args else ""))
            out = [o for o in out if not (o & src)]
            if "LDG.E.128" in t:
                d = int(re.search(r"LDG\.E\.128 R(\d+)", t).group(1)); out.append({str(d + k) for k in range(4)}); loads += 1
            peak = max(peak, len(out))
        res.append(f"loop {len(body)} instr, {loads} rows, <= {peak} in flight")
print("; ".join(res), f"| spills {spill}")
