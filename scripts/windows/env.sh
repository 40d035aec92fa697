# Environment of every Wine call of the Windows CI job; sourced by scripts/windows-ci.sh and
# scripts/windows/winpy.sh. Expects CI_DIR (the work folder) to be set.
# Everything that could cache lands inside the work folder.
export WINEPREFIX="$CI_DIR/prefix"
export WINEARCH=win64
export WINEDEBUG="${WINEDEBUG:--all}"
export XDG_CACHE_HOME="$CI_DIR/cache/xdg"
export PIP_CACHE_DIR="$CI_DIR/cache/pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1
export TMPDIR="$CI_DIR/tmp" TMP="$CI_DIR/tmp" TEMP="$CI_DIR/tmp"
# mscoree/mshtml disabled: no Wine Mono/Gecko download prompts; winemenubuilder disabled: no
# desktop entries written into $HOME.
export WINEDLLOVERRIDES="msvcp140,msvcp140_1,msvcp140_2,msvcp140_atomic_wait,msvcp140_codecvt_ids,vcruntime140,vcruntime140_1,concrt140,vcomp140=n,b;mscoree,mshtml=;winemenubuilder.exe=d"
# Intel OpenMP's affinity probe calls GetNumaNodeProcessorMaskEx, which Wine lacks.
export KMP_AFFINITY=disabled
# Windows torch has no libuv; the library must cope without it, so the job does not set it.
unset USE_LIBUV
export PYTHONUNBUFFERED=1
# Nothing of the Linux Python environment leaks into the Windows one.
unset PYTHONPATH PYTHONHOME VIRTUAL_ENV

# Lets the Windows tests assert that they really run on a Windows interpreter.
export SHARDWISE_EXPECT_WINDOWS=1
