"""Find the Wine gaps in a log of the Windows CI job and print one summary line per gap.

A gap is a Windows API that Wine lacks; the Windows program, not shardwise, then fails.
Wine reports it in one of these ways, each turned into ``WINE GAP: <dll>.<function>``:

* ``wine: Unimplemented function KERNEL32.dll.Foo called at address ...`` (a stub that
  crashes the process);
* ``Function Foo() failed`` followed by ``Call not implemented`` (a stub that returns
  ERROR_CALL_NOT_IMPLEMENTED; Intel OpenMP prints this for GetNumaNodeProcessorMaskEx);
* ``Library foo.dll (which is needed by ...) not found`` (a DLL Wine does not have; shown
  when WINEDEBUG includes err+module, the default outside the job).

    python wine_gaps.py LOGFILE      # prints the WINE GAP lines, exit code 0 either way
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Iterable, List

_UNIMPLEMENTED = re.compile(r"wine: Unimplemented function (\S+?)(?: called|\s|$)")
_FAILED_CALL = re.compile(r"Function (\w+)\(\) failed")
_NOT_IMPLEMENTED = re.compile(r"Call not implemented", re.IGNORECASE)
_MISSING_DLL = re.compile(r"Library (\S+\.dll) \(which is needed by", re.IGNORECASE)


def find_gaps(lines: Iterable[str]) -> List[str]:
    """The distinct gaps in ``lines``, in order of first appearance."""
    gaps: List[str] = []
    previous = ""
    for line in lines:
        found = None
        match = _UNIMPLEMENTED.search(line)
        if match:
            found = match.group(1)
        elif _NOT_IMPLEMENTED.search(line):
            call = _FAILED_CALL.search(previous) or _FAILED_CALL.search(line)
            found = f"{call.group(1)} (call not implemented)" if call else "unknown call (call not implemented)"
        else:
            match = _MISSING_DLL.search(line)
            if match:
                found = f"{match.group(1)} (DLL missing)"
        if found and found not in gaps:
            gaps.append(found)
        previous = line
    return gaps


def main(argv: List[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[0])
    if not path.is_file():
        return 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for gap in find_gaps(f):
            print(f"WINE GAP: {gap}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
