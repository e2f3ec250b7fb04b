"""Reading compiled kernels as text: the SASS of `cuobjdump -sass` (instructions, the main loop, what one
iteration issues) and the PTX (which kernel argument each global load reads, and how wide). Pure functions of
the text; kernels.inspect compiles and calls them."""
from __future__ import annotations

import re
from collections import Counter, defaultdict

MMA_OPS = ("HGMMA", "HMMA")


# --- SASS -----------------------------------------------------------------------------------------------------

SASS_RE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def parse_sass(text: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every instruction in `cuobjdump -sass` output; predicates dropped."""
    out = []
    for line in text.splitlines():
        m = SASS_RE.search(line)
        if not m:
            continue
        body = m.group(2).strip()
        if body.startswith("@"):
            body = body.split(None, 1)[1] if " " in body else ""
        op, _, operands = body.partition(" ")
        out.append((int(m.group(1), 16), op, operands.strip()))
    return out


def _kind(op: str) -> str:
    return op.split(".")[0]


def main_loop(instrs: list[tuple[int, str, str]], mma: bool = True) -> list[tuple[int, str, str]]:
    """The main loop: the widest span [target, branch] of a backward BRA that holds a tensor-core instruction
    (the K loop is the only loop with a dot; the BRA-to-itself after EXIT is not a loop), or with mma=False
    (the decode kernels: fp32 FMA, one K loop) the widest backward span. [] if none."""
    best: list = []
    for addr, op, operands in instrs:
        t = re.match(r"(0x[0-9a-f]+)", operands)
        if _kind(op) != "BRA" or not t or int(t.group(1), 16) >= addr:
            continue
        body = [i for i in instrs if int(t.group(1), 16) <= i[0] <= addr]
        if (not mma or any(_kind(i[1]) in MMA_OPS for i in body)) and len(body) > len(best):
            best = body
    return best


def loop_stats(body: list[tuple[int, str, str]]) -> dict:
    """Instructions of one iteration (NOPs not counted) and the kinds that matter."""
    ops = [op for _, op, _ in body if op != "NOP"]
    kind = _kind
    return {"instructions": len(ops), "start": hex(body[0][0]) if body else None,
            "end": hex(body[-1][0]) if body else None,
            "mma": dict(Counter(op for op in ops if kind(op) in MMA_OPS)),
            "global_loads": dict(Counter(op for op in ops if kind(op) in ("LDG", "LDGSTS", "UTMALDG"))),
            "shared_accesses": sum(kind(op) in ("LDS", "LDSM", "STS") for op in ops),
            "local_accesses": sum(kind(op) in ("LDL", "STL") for op in ops),
            "by_kind": dict(Counter(map(kind, ops)).most_common())}


# --- PTX: which stream each global load reads, and how wide ---------------------------------------------------

PTX_REG = re.compile(r"%[a-z]+\d+")
PARAM_RE = re.compile(r"ld\.param\.\w+\s+(%\w+),\s*\[\w+_param_(\d+)\]")


def _first_operand(rest: str) -> tuple[str, str]:
    end = rest.index("}") + 1 if rest.startswith("{") else (rest.index(",") if "," in rest else len(rest))
    return rest[:end], rest[end:]


def ptx_streams(ptx: str, streams: dict[int, str]) -> dict:
    """Per stream, the global loads of one main-loop iteration (per thread): {"<kind> <bytes>B": count} and
    the distinct (register, offset) addresses among them. A load's stream is the kernel pointer argument
    (`streams`: parameter index -> stream name) its
    address is computed from (def-use chains through the PTX); the loop is LLVM's "Loop Header" label up to
    the last branch back to it (the whole kernel if there is none)."""
    raw_lines = ptx.splitlines()
    lines = [raw.split("//")[0].strip().rstrip(";").strip() for raw in raw_lines]
    defs: dict[str, set[str]] = defaultdict(set)
    roots: dict[str, int] = {}
    loads = []  # (line, kind, bytes, address register, offset)
    for i, line in enumerate(lines):
        if line.startswith("@"):
            line = line.split(None, 1)[1] if " " in line or "\t" in line else ""
        if not line or line[0] in ".{}$" or line.endswith(":"):
            continue
        if p := PARAM_RE.match(line):
            roots[p.group(1)] = int(p.group(2))
            continue
        op, _, rest = line.replace("\t", " ").partition(" ")
        rest = rest.strip()
        addrs = re.findall(r"\[\s*(%\w+)\s*(?:\+\s*(-?\w+))?\s*\]", rest)
        if op.startswith("ld.global") and addrs:
            vec = re.search(r"\.v(\d)", op)
            bits = re.search(r"\.[bsuf](\d+)$", op)
            loads.append((i, "ld", (int(vec.group(1)) if vec else 1) * int(bits.group(1)) // 8, *addrs[0]))
        elif op.startswith("cp.async") and ".global" in op and len(addrs) == 2:
            size = re.search(r"\]\s*,\s*(0x[0-9a-f]+|\d+)", rest.split("]", 1)[1])
            loads.append((i, "async", int(size.group(1), 0), *addrs[1]))
        if not rest or rest.startswith("["):
            continue
        first, others = _first_operand(rest)
        for d in PTX_REG.findall(first):
            defs[d].update(PTX_REG.findall(others))

    def pointer_args(reg: str) -> set[int]:
        seen, stack, found = {reg}, [reg], set()
        while stack:
            r = stack.pop()
            if r in roots and roots[r] in streams:
                found.add(roots[r])
            for s in defs.get(r, ()):
                if s not in seen:
                    seen.add(s)
                    stack.append(s)
        return found

    header = next((i for i, raw in enumerate(raw_lines) if "Loop Header" in raw and lines[i].endswith(":")), None)
    lo, hi = 0, len(lines)
    if header is not None:
        label = lines[header][:-1]
        backs = [i for i, l in enumerate(lines) if re.search(rf"\bbra(\.uni)?\s+{re.escape(label)}$", l)]
        if backs:
            lo, hi = header, max(backs)
    out: dict[str, dict] = {}
    for i, kind, nbytes, reg, off in loads:
        if not lo <= i <= hi:
            continue
        ptrs = pointer_args(reg)
        name = streams[ptrs.pop()] if len(ptrs) == 1 else "unattributed"
        s = out.setdefault(name, {"loads": Counter(), "addresses": set()})
        s["loads"][f"{kind} {nbytes}B"] += 1
        s["addresses"].add((reg, off or "0"))
    return {k: {"loads": dict(v["loads"]), "distinct_addresses": len(v["addresses"])} for k, v in out.items()}
