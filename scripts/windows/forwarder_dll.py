"""Write a code-free Windows DLL whose exports forward to functions of another DLL.

Why: Wine 8.0 (Debian 12's) has no ``bcryptprimitives.dll``, but the win_amd64 wheels of
pydantic-core and safetensors are built with Rust >= 1.78, whose standard library imports
``bcryptprimitives.ProcessPrng`` for random numbers. Without the DLL, ``import
pydantic_core`` fails with "DLL load failed ... Module not found". ``ProcessPrng(buf, len)``
has the same contract as ``advapi32.SystemFunction036`` (RtlGenRandom: fill ``buf`` with
``len`` random bytes, return TRUE), which Wine has, so a DLL made only of export
*forwarders* is enough: the Windows loader resolves ``bcryptprimitives.ProcessPrng`` to
``advapi32.SystemFunction036`` itself. The file holds headers, an export table and an empty
relocation block: no machine code, nothing compiled.

    python forwarder_dll.py OUT.dll bcryptprimitives.dll ProcessPrng=advapi32.SystemFunction036
    python forwarder_dll.py --imports SOME.pyd bcryptprimitives.dll   # what SOME.pyd needs from it

Only the Windows CI job uses it (scripts/windows-ci.sh); real Windows has the DLL.
"""
from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Dict, List, Tuple

FILE_ALIGN = 0x200
SECTION_ALIGN = 0x1000
SECTION_RVA = 0x1000
IMAGE_BASE = 0x6_4B00_0000  # any free 64-bit base works: the empty reloc block allows moving


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def build_forwarder_dll(dll_name: str, forwards: Dict[str, str]) -> bytes:
    """Bytes of a PE32+ (x64) DLL named ``dll_name`` exporting ``name -> "dll.function"``."""
    names = sorted(forwards)  # the export name table must be sorted for the loader's search
    n = len(names)
    # Layout of the export data (all RVAs relative to the image base).
    dir_rva = SECTION_RVA
    eat_rva = dir_rva + 40
    ent_rva = eat_rva + 4 * n
    ord_rva = ent_rva + 4 * n
    strings = bytearray()
    str_base = ord_rva + 2 * n

    def add_string(text: str) -> int:
        rva = str_base + len(strings)
        strings.extend(text.encode("ascii") + b"\0")
        return rva

    name_rva = add_string(dll_name)
    name_rvas = [add_string(name) for name in names]
    # A function RVA that points inside the export directory marks a forwarder string.
    target_rvas = [add_string(forwards[name]) for name in names]
    export_size = str_base + len(strings) - dir_rva
    export = struct.pack("<IIHHIIIIIII", 0, 0, 0, 0, name_rva, 1, n, n, eat_rva, ent_rva, ord_rva)
    export += b"".join(struct.pack("<I", rva) for rva in target_rvas)
    export += b"".join(struct.pack("<I", rva) for rva in name_rvas)
    export += b"".join(struct.pack("<H", i) for i in range(n))
    export += bytes(strings)
    # An empty base-relocation block: nothing needs fixing, but its presence lets the loader
    # map the DLL at any address (DYNAMIC_BASE) instead of failing when IMAGE_BASE is taken.
    reloc_rva = _align(dir_rva + len(export), 4)
    section = export + b"\0" * (reloc_rva - dir_rva - len(export))
    section += struct.pack("<IIHH", SECTION_RVA, 12, 0, 0)
    reloc_size = 12
    raw_size = _align(len(section), FILE_ALIGN)
    virtual_size = len(section)
    image_size = _align(SECTION_RVA + virtual_size, SECTION_ALIGN)

    dos = b"MZ" + b"\0" * 58 + struct.pack("<I", 0x40)
    coff = struct.pack("<HHIIIHH", 0x8664, 1, 0, 0, 0, 240, 0x0002 | 0x0020 | 0x2000)
    opt = struct.pack("<HBBIIIII", 0x20B, 14, 0, 0, raw_size, 0, 0, SECTION_RVA)
    opt += struct.pack("<QIIHHHHHHIIIIHH", IMAGE_BASE, SECTION_ALIGN, FILE_ALIGN, 6, 0, 0, 0, 6, 0,
                       0, image_size, FILE_ALIGN, 0, 3, 0x0040 | 0x0020 | 0x0100)
    opt += struct.pack("<QQQQII", 0x100000, 0x1000, 0x100000, 0x1000, 0, 16)
    dirs = [(0, 0)] * 16
    dirs[0] = (dir_rva, export_size)
    dirs[5] = (reloc_rva, reloc_size)
    opt += b"".join(struct.pack("<II", rva, size) for rva, size in dirs)
    assert len(opt) == 240
    sect = struct.pack("<8sIIIIIIHHI", b".rdata", virtual_size, SECTION_RVA, raw_size, FILE_ALIGN,
                       0, 0, 0, 0, 0x40000040)
    headers = dos + b"PE\0\0" + coff + opt + sect
    headers += b"\0" * (FILE_ALIGN - len(headers))
    return headers + section + b"\0" * (raw_size - len(section))


def _sections(data: bytes) -> Tuple[int, List[Tuple[int, int, int]]]:
    pe = struct.unpack_from("<I", data, 0x3C)[0]
    if data[pe:pe + 4] != b"PE\0\0":
        raise ValueError("not a PE file")
    nsect, opt_size = struct.unpack_from("<xxHxxxxxxxxxxxxHxx", data, pe + 4)
    opt = pe + 24
    table = opt + opt_size
    sections = []
    for i in range(nsect):
        vsize, vaddr, rsize, rptr = struct.unpack_from("<IIII", data, table + 40 * i + 8)
        sections.append((vaddr, max(vsize, rsize), rptr))
    return opt, sections


def _rva_to_offset(sections: List[Tuple[int, int, int]], rva: int) -> int:
    for vaddr, size, rptr in sections:
        if vaddr <= rva < vaddr + size:
            return rva - vaddr + rptr
    raise ValueError(f"RVA {rva:#x} is in no section")


def _cstr(data: bytes, offset: int) -> str:
    return data[offset:data.index(b"\0", offset)].decode("ascii")


def imports_from(pe_path: Path, dll_name: str) -> List[str]:
    """Function names that the PE file ``pe_path`` imports from ``dll_name`` (case-insensitive)."""
    data = pe_path.read_bytes()
    opt, sections = _sections(data)
    imp_rva = struct.unpack_from("<I", data, opt + 112 + 8)[0]  # data directory 1 (PE32+)
    found: List[str] = []
    offset = _rva_to_offset(sections, imp_rva)
    while True:
        lookup, _, _, name_rva, thunk = struct.unpack_from("<IIIII", data, offset)
        if name_rva == 0:
            return found
        if _cstr(data, _rva_to_offset(sections, name_rva)).lower() == dll_name.lower():
            entry = _rva_to_offset(sections, lookup or thunk)
            while True:
                (value,) = struct.unpack_from("<Q", data, entry)
                if value == 0:
                    break
                if not value >> 63:  # by name (not by ordinal): hint, then the name
                    found.append(_cstr(data, _rva_to_offset(sections, value & 0x7FFFFFFF) + 2))
                entry += 8
        offset += 20


def exports_of(pe_path: Path) -> Dict[str, str]:
    """``name -> forwarder`` of a DLL's export table (forwarders only; code exports -> "")."""
    data = pe_path.read_bytes()
    opt, sections = _sections(data)
    exp_rva, exp_size = struct.unpack_from("<II", data, opt + 112)
    base = _rva_to_offset(sections, exp_rva)
    (_, _, _, _, _, _, nfunc, nname, eat, ent, ords) = struct.unpack_from("<IIHHIIIIIII", data, base)
    result = {}
    for i in range(nname):
        name = _cstr(data, _rva_to_offset(sections, struct.unpack_from("<I", data, _rva_to_offset(sections, ent) + 4 * i)[0]))
        index = struct.unpack_from("<H", data, _rva_to_offset(sections, ords) + 2 * i)[0]
        rva = struct.unpack_from("<I", data, _rva_to_offset(sections, eat) + 4 * index)[0]
        inside = exp_rva <= rva < exp_rva + exp_size
        result[name] = _cstr(data, _rva_to_offset(sections, rva)) if inside else ""
    return result


def main(argv: List[str]) -> int:
    if len(argv) == 3 and argv[0] == "--imports":
        for name in imports_from(Path(argv[1]), argv[2]):
            print(name)
        return 0
    if len(argv) < 3 or any("=" not in a for a in argv[2:]):
        print(__doc__, file=sys.stderr)
        return 2
    forwards = dict(a.split("=", 1) for a in argv[2:])
    out = Path(argv[0])
    out.write_bytes(build_forwarder_dll(argv[1], forwards))
    assert exports_of(out) == forwards, exports_of(out)
    print(f"wrote {out} ({out.stat().st_size} bytes): " +
          ", ".join(f"{k} -> {v}" for k, v in forwards.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
