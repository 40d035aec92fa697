#!/usr/bin/env bash
# Run the Windows Python of the Windows CI job by hand, with the job's environment:
#
#   bash scripts/windows/winpy.sh -c "import torch; print(torch.__version__)"
#   bash scripts/windows/winpy.sh -m pytest tests/windows -k launcher -v
#
# Needs a work folder made by scripts/windows-ci.sh (WINE_CI_DIR, default <repo>/.wine-ci).
# Output is piped, never redirected to a file (the Windows Python cannot write to a
# redirected file under Wine); the exit code is python.exe's.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CI_DIR="${WINE_CI_DIR:-$REPO/.wine-ci}"
[[ -x "$CI_DIR/python/python.exe" || -f "$CI_DIR/python/python.exe" ]] \
  || { echo "no Windows Python in $CI_DIR: run scripts/windows-ci.sh first" >&2; exit 2; }
# shellcheck source=env.sh
source "$REPO/scripts/windows/env.sh"
cd "$REPO" || exit 2
wine "$CI_DIR/python/python.exe" "$@" 2>&1 | cat
rc=${PIPESTATUS[0]}
exit "$rc"
